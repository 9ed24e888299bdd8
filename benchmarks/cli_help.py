"""`vlm-pack --help` and each subcommand's `--help`: wall time of a fresh process, as a user types it.

Each measurement runs the console script that sits next to this interpreter (``vlm-pack``, falling back to
``python -m vlm_pack.cli.main``) in a new process; rounds interleave the commands, with the bare interpreter start-up
(``python -c pass``) as the floor. Also records which heavy modules one process imports for all the help texts
(none of torch / transformers may load). Prints medians [min-max] and writes ``benchmarks/results/cli_help.md``.

    python benchmarks/cli_help.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlm_pack.cli.main import SUBCOMMANDS  # noqa: E402  (light: the parser modules are imported per command)

HEAVY = ("torch", "transformers", "datasets", "numba", "numpy")


def console_script() -> list[str]:
    script = Path(sys.executable).parent / "vlm-pack"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vlm_pack.cli.main"]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def heavy_imports() -> list[str]:
    code = ("import sys; from vlm_pack.cli.main import SUBCOMMANDS, main\n"
            "for argv in [['--help']] + [[name, '--help'] for name in SUBCOMMANDS]:\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True)
    return run.stdout.strip().splitlines()[-1].split() if run.stdout.strip() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each command once per round)")
    args = parser.parse_args()
    script = console_script()
    commands = {"python -c pass (floor)": [sys.executable, "-c", "pass"], "vlm-pack --help": [*script, "--help"]}
    commands.update({f"vlm-pack {name} --help": [*script, name, "--help"] for name in SUBCOMMANDS})
    for cmd in commands.values():  # warm the file cache and the .pyc files
        timed(cmd)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, cmd in commands.items():
            times[name].append(timed(cmd))
    load = os.getloadavg()[0]
    heavy = heavy_imports()
    rows = [f"| `{name}` | {statistics.median(t):.2f} s [{min(t):.2f}-{max(t):.2f}] |" for name, t in times.items()]
    text = "\n".join([
        "# `--help` wall time (fresh process each)",
        "",
        f"{' '.join(script)}; median [min-max] of {args.repeats} interleaved rounds; load average {load:.1f} at the "
        f"end. Modules among {', '.join(HEAVY)} that one process printing every help text imported: "
        f"{', '.join(heavy) or 'none'}.",
        "",
        "| command | wall |",
        "|---|---|",
        *rows,
        "",
    ])
    print(text)
    out = ROOT / "benchmarks" / "results" / "cli_help.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
