"""Run the test suite on release sets of the Hugging Face stack overlaid on one virtualenv (torch shared).

    python scripts/check_versions.py SET... [-- PYTEST ARGS]      (scripts/check_versions.sh calls this)

SET: ``floor`` (every package of :data:`STACK` at scripts/floor_constraints.txt's release, where it names one), or
comma-separated pins (``transformers==5.24.0,accelerate==1.15.0``). For each set, pip resolves the stack with the
set's pins against the running virtualenv (``--dry-run --report``); what it would change is installed with
``--no-deps --target .overlays/<set>`` (git-ignored), and the suite runs with that directory first on
``PYTHONPATH`` (then the checkout). A set that would change torch is refused: the overlay shares the virtualenv's
torch (no second multi-GB virtualenv). Each run's counts, timings and failing test ids go to
benchmarks/results/versions.json (one entry per set, replaced on a re-run) and benchmarks/results/versions.md is
rewritten from it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STACK = ("transformers", "accelerate", "trl", "peft", "datasets", "huggingface_hub", "tokenizers", "safetensors")
"""The packages a set pins (what the issue's overlay names); their dependencies follow pip's resolution."""
RESULTS = ROOT / "benchmarks" / "results"
SHARED = {"torch", "torchvision", "triton"}


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0].strip().lower().replace("-", "_")


def pins_of(spec: str) -> list[str]:
    """The set's pins: ``floor`` from scripts/floor_constraints.txt (the STACK packages it names), else the list."""
    if spec == "floor":
        lines = (ROOT / "scripts" / "floor_constraints.txt").read_text().splitlines()
        return [line.strip() for line in lines if line.strip() and not line.startswith("#")
                and _name(line) in STACK]
    return [pin.strip() for pin in spec.split(",") if pin.strip()]


def resolve(pins: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every package pip would install or replace in the running virtualenv for ``pins``."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "c.txt"
        constraints.write_text("\n".join(pins) + "\n")
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report),
                        "-c", str(constraints), *STACK], check=True, stdout=subprocess.DEVNULL)
        found = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in found]


def build_overlay(spec: str) -> tuple[Path, list[tuple[str, str]], float]:
    """The set's overlay directory (built once, reused while its packages match), its packages, build seconds."""
    start = time.perf_counter()
    packages = resolve(pins_of(spec))
    changed = sorted(_name(name) for name, _ in packages if _name(name) in SHARED)
    if changed:
        raise SystemExit(f"{spec}: pip would replace {', '.join(changed)}; the overlay shares the virtualenv's torch")
    overlay = ROOT / ".overlays" / re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)
    stamp = overlay / "vlm_pack_overlay.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != packages:
        subprocess.run(["rm", "-rf", str(overlay)], check=True)
        if packages:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(overlay),
                            *(f"{name}=={version}" for name, version in packages)], check=True)
        overlay.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(packages))
    return overlay, packages, time.perf_counter() - start


def _env(overlay: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(ROOT)]), "OMP_NUM_THREADS": "1"}


def versions(overlay: Path) -> dict[str, str]:
    """What the overlaid interpreter imports: each STACK package's version, and the registered families' coverage
    of its image-text-to-text model types."""
    code = ("import importlib.metadata as m, json, torch; from vlm_pack.models.table import vlm_coverage; "
            f"v = {{p: m.version(p) for p in {list(STACK)!r}}}; v['torch'] = torch.__version__; "
            "c = vlm_coverage(); v['coverage'] = f'{c[0]} of {c[1]}'; print(json.dumps(v))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(overlay), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_suite(overlay: Path, args: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=_env(overlay), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = done.stdout.splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    counts = {key: int(n) for n, key in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    failing = sorted({line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))})
    return {"summary": summary, "counts": counts, "seconds": round(seconds), "failing": failing,
            "returncode": done.returncode}


def write_report(entries: dict[str, dict]) -> None:
    (RESULTS / "versions.json").write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    head = ["# The test suite on release sets of the Hugging Face stack (`bash scripts/check_versions.sh`)", "",
            "Each set is overlaid on the project's virtualenv (`pip install --no-deps --target .overlays/<set>` of "
            "what pip's resolution of " + ", ".join(f"`{p}`" for p in STACK) + " with the set's pins would change; "
            "`PYTHONPATH` first; torch shared). Generated by scripts/check_versions.py from versions.json.", ""]
    columns = ["set", "run", "torch", *STACK, "families' coverage of image-text-to-text types", "pytest",
               "passed", "failed", "errors", "skipped", "suite s", "overlay s"]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    notes = []
    for spec, entry in entries.items():
        v, c = entry["versions"], entry["counts"]
        table.append("| " + " | ".join([f"`{spec}`", entry["date"], v["torch"], *(v[p] for p in STACK),
                                        v["coverage"], f"`{' '.join(entry['args'])}`",
                                        *(str(c.get(k, 0)) for k in ("passed", "failed", "errors", "skipped")),
                                        str(entry["seconds"]), str(entry["overlay_seconds"])]) + " |")
        if entry["failing"]:
            notes += ["", f"Failing or erroring on `{spec}` ({len(entry['failing'])}):", "",
                      *(f"- `{test}`" for test in entry["failing"])]
    floor = ["", "The `floor` set is transformers 5.17.0 / accelerate 1.15.0 / PEFT 0.18.0 / datasets 4.7.0 "
             "(scripts/floor_constraints.txt) on the virtualenv's torch, not torch 2.11: it proves the Hugging Face "
             "floors; the torch floor needs the ~4 GB virtualenv of scripts/check_floors.sh "
             "(benchmarks/results/floors.md). `overlay s`: resolving the set and installing what it changes (reused "
             "while the set resolves the same); `suite s`: the pytest run, wall clock."]
    (RESULTS / "versions.md").write_text("\n".join(head + table + floor + notes + [""]))


def main(argv: list[str]) -> int:
    sets, args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if not sets:
        print(__doc__, file=sys.stderr)
        return 2
    path = RESULTS / "versions.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    for spec in sets:
        overlay, packages, build = build_overlay(spec)
        print(f"{spec}: overlay {overlay} ({len(packages)} packages, {build:.0f} s)", flush=True)
        result = run_suite(overlay, args or ["-n", "2"])
        print(f"{spec}: {result['summary']}", flush=True)
        entries[spec] = {"versions": versions(overlay), "args": args or ["-n", "2"],
                         "overlay_seconds": round(build), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                         **result}
        write_report(entries)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
