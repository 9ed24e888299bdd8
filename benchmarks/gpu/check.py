"""The GPU check's driver: every stage in its own process with its own time box, in order of value, each stage's
section written to ``gpu_report.md`` / ``gpu_results.json`` as soon as it ends.

The parent imports torch and transformers once (never touching CUDA) and forks one child per stage, so a stage
pays no import time and a crash, hang or CUDA fault in one stage is recorded ("failed: ...") while the next one
runs. A child is killed with its whole process group (pytest, compile workers) when its box runs out; what it had
saved with ``ctx.save`` stays in the report. ``--dry-run``: the same stages on CPU at tiny shapes.

Run through ``benchmarks/gpu/run.sh`` (it installs the carried wheels first); docs/gpu_check.md explains the report.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu.common import ROOT, Context, Result, Skip, finite

# (stage, module, time box in seconds on the GPU): the sum stays under 7.5 minutes, leaving the wheel install and
# the imports inside an 8-minute run.
STAGES = (
    ("machine", "machine", 20),
    ("kernels", "kernels", 100),
    ("exactness", "exactness", 40),
    ("speed", "speed", 95),
    ("grpo", "grpo_step", 60),
    ("long_rows", "long_rows", 40),
    ("compile", "recompiles", 75),
)
INJECTED = (("injected_crash", None, 30), ("injected_hang", None, 1))  # --inject-failures: the driver's own proof
TITLES = {"machine": "a. machine", "kernels": "b. kernels", "exactness": "c. exactness on the device",
          "speed": "d. speed and memory: one training step", "grpo": "e. GRPO step", "long_rows": "f. long rows",
          "compile": "g. torch.compile"}


def _run_child(name: str, module: str | None, ctx: Context, result_path: Path) -> None:
    """In the forked child: run the stage and write its outcome; never returns."""
    os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    code = 0
    try:
        if name == "injected_crash":
            os.abort()
        if name == "injected_hang":
            time.sleep(3600)
        result: Result = importlib.import_module(f"benchmarks.gpu.{module}").run(ctx)
        outcome = {"status": "ok", "markdown": result.markdown, "data": result.data, "checks": result.checks}
    except Skip as skip:
        outcome = {"status": f"skipped: {skip}"}
    except BaseException as error:  # recorded, never hidden: the report names it and the log has the traceback
        traceback.print_exc()
        outcome = {"status": f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
        code = 1
    try:
        partial = json.loads(ctx.partial_path.read_text())["partial"] if ctx.partial_path.exists() else None
        if partial is not None and "data" not in outcome:
            outcome["data"] = partial
        result_path.write_text(json.dumps(finite(outcome)))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_stage(name: str, module: str | None, box: float, dry: bool, device: str) -> dict:
    """Fork, wait at most ``box`` seconds, and return the stage's record (status, seconds, data)."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
    result_path, partial_path = folder / "result.json", folder / "partial.json"
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _run_child(name, module, Context(dry=dry, device=device, partial_path=partial_path, deadline=start + box),
                   result_path)
    status = None
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > box:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = f"failed: timed out after {box:g} s (killed; what it had saved is kept)"
            break
        time.sleep(0.05)
    try:  # leftovers of a finished child (compile workers) go with it
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    seconds = time.monotonic() - start
    record = json.loads(result_path.read_text()) if result_path.exists() else {}
    if status is None and not record:
        how = (f"killed by signal {signal.Signals(os.WTERMSIG(wait_status)).name}" if os.WIFSIGNALED(wait_status)
               else f"exit code {os.WEXITSTATUS(wait_status)}")
        status = f"failed: the stage process died ({how}) before reporting; see the log"
    if status is not None:
        record["status"] = status
        if partial_path.exists():
            record["data"] = json.loads(partial_path.read_text())["partial"]
    for path in (result_path, partial_path):
        path.unlink(missing_ok=True)
    folder.rmdir()
    return {"name": name, "status": record["status"], "seconds": round(seconds, 1), "box_s": box,
            "markdown": record.get("markdown", []), "data": record.get("data", {}), "checks": record.get("checks", {})}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def render(meta: dict, stages: list[dict]) -> str:
    lines = ["# vlm_pack GPU check", "",
             f"{meta['mode']}. Started {meta['started']}; python {meta['python']}; "
             f"wheels: {meta['wheels']}. Command: `{meta['command']}`.", "",
             "| stage | status | seconds (time box) |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} ({s['box_s']:g}) |" for s in stages]
    checks = [(s["name"], check, ok) for s in stages for check, ok in s["checks"].items()]
    failed = [f"{name}: {check}" for name, check, ok in checks if not ok]
    lines += ["", f"Checks: {len(checks) - len(failed)} of {len(checks)} passed."
              + ("" if not failed else " FAILED: " + "; ".join(failed))]
    for s in stages:
        lines += ["", f"## {TITLES.get(s['name'], s['name'])}: {s['status']}", ""]
        lines += s["markdown"] or (["(partial data in gpu_results.json)"] if s["data"] else [])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on CPU at tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stages", default=",".join(s for s, _, _ in STAGES), help="comma-separated subset")
    parser.add_argument("--box", action="append", default=[], metavar="STAGE=SECONDS", help="override a time box")
    parser.add_argument("--inject-failures", action="store_true",
                        help="first run a stage that crashes and one that hangs past a 1 s box (proves the rest "
                             "still runs)")
    args = parser.parse_args(argv)
    wanted = args.stages.split(",")
    unknown = set(wanted) - {s for s, _, _ in STAGES}
    if unknown:
        parser.error(f"unknown stage(s) {sorted(unknown)}; choose from {[s for s, _, _ in STAGES]}")
    boxes = {stage: float(seconds) for stage, seconds in (item.split("=", 1) for item in args.box)}
    plan = [s for s in STAGES if s[0] in wanted]
    if args.inject_failures:
        plan = [*INJECTED, *plan]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"mode": "Dry run: CPU, tiny shapes (the code path check)" if args.dry_run
            else "GPU run: real shapes, bf16 unless stated",
            "dry_run": args.dry_run, "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "wheels": os.environ.get("GPU_CHECK_WHEELS", "none installed"),
            "command": "bash benchmarks/gpu/run.sh" + (" --dry-run" if args.dry_run else "")}
    try:  # shared by every forked stage; none of this touches CUDA
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import vlm_pack.testing.tiny_models  # noqa: F401
    except Exception as error:  # each stage then reports its own import failure
        print(f"pre-import failed: {type(error).__name__}: {error}", flush=True)
    stages: list[dict] = []
    for name, module, box in plan:
        box = boxes.get(name, box)
        print(f"=== stage {name} (time box {box:g} s)", flush=True)
        record = run_stage(name, module, box, args.dry_run, "cpu" if args.dry_run else "cuda")
        print(f"=== stage {name}: {record['status']} in {record['seconds']} s", flush=True)
        stages.append(record)
        _atomic_write(out / "gpu_results.json", json.dumps(finite({"meta": meta, "stages": stages}), indent=1) + "\n")
        _atomic_write(out / "gpu_report.md", render(meta, stages))
    print(f"wrote {out / 'gpu_report.md'} and {out / 'gpu_results.json'}", flush=True)
    return 0 if all(s["status"] == "ok" or s["status"].startswith("skipped: ") for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
