"""The GPU check's driver: every stage in its own process with its own time box, in order of value, each stage's
section written to ``gpu_report.md`` / ``gpu_results.json`` as soon as it ends.

The parent imports torch and transformers once and forks one child per stage, so a stage pays no import time and a
crash, hang or CUDA fault in one stage is recorded ("failed: ...") while the next one runs. The parent never
initialises CUDA (a forked child of a CUDA parent cannot use CUDA): it checks ``torch.cuda.is_initialized()``
before every stage and starts the stage with ``spawn`` instead of ``fork`` if anything did (the report says
which). A child dumps every thread's traceback (``faulthandler``) a few seconds before its box runs out, then is
killed with its whole process group (pytest, compile workers); what it had saved with ``ctx.save`` stays in the
report. Boxes: each stage gets its own box plus the time earlier stages left unused, never the later stages' boxes,
all inside the run's budget (``GPU_CHECK_BUDGET_S``, counted from run.sh's start). ``--dry-run``: the same stages
on CPU at tiny shapes.

Run through ``benchmarks/gpu/run.sh`` (it installs the carried wheels and probes them first); docs/gpu_check.md
explains the report.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib
import json
import multiprocessing
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu.common import ROOT, Context, Result, Skip, finite

# (stage, module, time box in seconds on the GPU). The sum (470 s) + the wheel install, deep probe and parent
# imports (measured 35 s at load ~10 on 2 CPUs, 190 s at load 11.6 beside a test run; the GPU machine has 16 idle
# cores) stays inside BUDGET_S = 525 s (boxes shrink in proportion when it does not), under the
# device call's 540 s. Sized from cold-compile costs (docs/gpu_check.md "Time boxes"): a cold FlexAttention
# compile of forward + backward ~15 s per distinct mask / score kind on an H100-class GPU with 16 compile workers
# (assumed: never measured here), the kernels stage compiles 4 kinds (packed, image blocks + window + softcap,
# shared prefix, speed shapes are dynamic) before `pytest -m gpu` (~40 s); speed compiles flex once more for its
# packed-through-flex layout; inductor's first compile of compile.py's tiny model ~30 s per mode.
STAGES = (
    ("machine", "machine", 15),
    ("kernels", "kernels", 150),
    ("exactness", "exactness", 30),
    ("speed", "speed", 130),
    ("grpo", "grpo_step", 50),
    ("long_rows", "long_rows", 35),
    ("compile", "recompiles", 60),
)
BUDGET_S = 525.0  # the whole run, from run.sh's start (GPU_CHECK_T0) to the last report write
DUMP_BEFORE_KILL_S = 3.0  # faulthandler dumps the child's tracebacks this long before its box runs out
INJECTED = (("injected_crash", None, 30), ("injected_hang", None, 1))  # --inject-failures: the driver's own proof
TITLES = {"machine": "a. machine", "kernels": "b. kernels", "exactness": "c. exactness on the device",
          "speed": "d. speed and memory: one training step", "grpo": "e. GRPO step", "long_rows": "f. long rows",
          "compile": "g. torch.compile"}


def _run_child(name: str, module: str | None, ctx: Context, result_path: Path, box: float) -> None:
    """In the child: run the stage and write its outcome; never returns."""
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    except PermissionError:  # already a group leader (spawn)
        pass
    faulthandler.enable()  # a segfault / abort prints the Python traceback
    faulthandler.dump_traceback_later(max(0.5 * box, box - DUMP_BEFORE_KILL_S), exit=False)
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


def _spawned_child(name: str, module: str | None, ctx: Context, result_path: str, box: float) -> None:
    """The spawn start method's entry point (a fresh interpreter: imports are paid again)."""
    _run_child(name, module, ctx, Path(result_path), box)


def start_method() -> str:
    """``fork`` while this process has not initialised CUDA (a forked child of a CUDA parent dies with "Cannot
    re-initialize CUDA in forked subprocess"), else ``spawn``."""
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def _kill_group(pid: int) -> None:
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run_stage(name: str, module: str | None, box: float, dry: bool, device: str) -> dict:
    """Start the stage (fork, or spawn if this process has initialised CUDA), wait at most ``box`` seconds, and
    return the stage's record (status, seconds, start method, data)."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
    result_path, partial_path = folder / "result.json", folder / "partial.json"
    sys.stdout.flush()
    sys.stderr.flush()
    method = start_method()
    start = time.monotonic()
    ctx = Context(dry=dry, device=device, partial_path=partial_path, deadline=start + box)
    process = None
    if method == "fork":
        pid = os.fork()
        if pid == 0:
            _run_child(name, module, ctx, result_path, box)
    else:
        process = multiprocessing.get_context("spawn").Process(
            target=_spawned_child, args=(name, module, ctx, str(result_path), box))
        process.start()
        pid = process.pid
    status, exit_code = None, 0  # exit_code: negative = killed by that signal (multiprocessing's convention)
    while True:
        if process is None:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                exit_code = (-os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status)
                             else os.WEXITSTATUS(wait_status))
                break
        else:
            process.join(0.0)
            if process.exitcode is not None:
                exit_code = process.exitcode
                break
        if time.monotonic() - start > box:
            _kill_group(pid)
            if process is None:
                os.waitpid(pid, 0)
            else:
                process.join()
            status = f"failed: timed out after {box:.0f} s (killed; what it had saved is kept)"
            break
        time.sleep(0.05)
    _kill_group(pid)  # leftovers of a finished child (compile workers) go with it
    seconds = time.monotonic() - start
    record = json.loads(result_path.read_text()) if result_path.exists() else {}
    if status is None and not record:
        how = (f"killed by signal {signal.Signals(-exit_code).name}" if exit_code < 0 else f"exit code {exit_code}")
        status = f"failed: the stage process died ({how}) before reporting; see the log"
    if status is not None:
        record["status"] = status
        if partial_path.exists():
            record["data"] = json.loads(partial_path.read_text())["partial"]
    for path in (result_path, partial_path):
        path.unlink(missing_ok=True)
    folder.rmdir()
    return {"name": name, "status": record["status"], "seconds": round(seconds, 1), "box_s": round(box, 1),
            "start_method": method,
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
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} ({s['box_s']:.0f}) |" for s in stages]
    probe = meta.get("probe") or {}
    lines += ["", f"Setup: stages started by `{meta['start_methods']}`; parent initialised CUDA: "
              f"{meta['parent_cuda_initialized']}; offline: {meta['offline']}; PYTHONPATH: `{meta['pythonpath']}`.",
              "Deep import probe (run.sh, before any stage): " + (", ".join(
                  f"{group} " + (f"ok ({entry.get('version') or 'imported'})" if entry["ok"] else f"FAILED ({entry['error']})")
                  for group, entry in probe.items() if isinstance(entry, dict)) or "not run")]
    checks = [(s["name"], check, ok) for s in stages for check, ok in s["checks"].items()]
    failed = [f"{name}: {check}" for name, check, ok in checks if not ok]
    lines += ["", f"Checks: {len(checks) - len(failed)} of {len(checks)} passed."
              + ("" if not failed else " FAILED: " + "; ".join(failed))]
    for s in stages:
        lines += ["", f"## {TITLES.get(s['name'], s['name'])}: {s['status']}", ""]
        lines += s["markdown"] or (["(partial data in gpu_results.json)"] if s["data"] else [])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on CPU at tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stages", default=",".join(s for s, _, _ in STAGES), help="comma-separated subset")
    parser.add_argument("--box", action="append", default=[], metavar="STAGE=SECONDS", help="override a time box")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", BUDGET_S)),
                        help="seconds for the whole run, counted from run.sh's start (GPU_CHECK_T0)")
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
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):  # run.sh exports them too
        os.environ.setdefault(name, "1")
    probe_path = os.environ.get("GPU_CHECK_PROBE")
    probe = json.loads(Path(probe_path).read_text()) if probe_path and Path(probe_path).is_file() \
        and Path(probe_path).stat().st_size else None
    meta = {"mode": "Dry run: CPU, tiny shapes (the code path check)" if args.dry_run
            else "GPU run: real shapes, bf16 unless stated",
            "dry_run": args.dry_run, "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "wheels": os.environ.get("GPU_CHECK_WHEELS", "none installed"),
            "command": "bash benchmarks/gpu/run.sh" + (" --dry-run" if args.dry_run else ""), "probe": probe,
            "offline": ", ".join(f"{n}={os.environ.get(n)}" for n in
                                 ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")),
            "pythonpath": os.environ.get("PYTHONPATH", ""), "budget_s": args.budget, "start_methods": "none"}
    try:  # shared by every forked stage; none of this touches CUDA
        import torch
        import transformers  # noqa: F401

        import vlm_pack.testing.tiny_models  # noqa: F401
    except Exception as error:  # each stage then reports its own import failure
        print(f"pre-import failed: {type(error).__name__}: {error}", flush=True)
    meta["parent_cuda_initialized"] = parent_cuda_initialized()
    t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())
    stages: list[dict] = []
    for i, (name, module, box) in enumerate(plan):
        remaining = args.budget - (time.time() - t0)
        later = sum(boxes.get(n, b) for n, _, b in plan[i + 1:])
        # a box set by --box or an injected stage's is exact; the others also get the time earlier stages left
        box = min(boxes[name], remaining) if name in boxes else (
            min(box, remaining) if module is None else allot(box, later, remaining))
        if box < 1:
            stages.append({"name": name, "status": "failed: no time left in the run's budget", "seconds": 0,
                           "box_s": 0, "start_method": "none", "markdown": [], "data": {}, "checks": {}})
            continue
        print(f"=== stage {name} (time box {box:.0f} s)", flush=True)
        record = run_stage(name, module, box, args.dry_run, "cpu" if args.dry_run else "cuda")
        print(f"=== stage {name}: {record['status']} in {record['seconds']} s", flush=True)
        stages.append(record)
        meta["parent_cuda_initialized"] = meta["parent_cuda_initialized"] or parent_cuda_initialized()
        meta["start_methods"] = ", ".join(sorted({s["start_method"] for s in stages}))
        meta["seconds_since_start"] = round(time.time() - t0, 1)
        _atomic_write(out / "gpu_results.json", json.dumps(finite({"meta": meta, "stages": stages}), indent=1) + "\n")
        _atomic_write(out / "gpu_report.md", render(meta, stages))
    print(f"wrote {out / 'gpu_report.md'} and {out / 'gpu_results.json'} ({time.time() - t0:.0f} s since run.sh "
          "started)", flush=True)
    checks_ok = all(all(s["checks"].values()) for s in stages)
    return 0 if checks_ok and all(s["status"] == "ok" or s["status"].startswith("skipped: ") for s in stages) else 1


def parent_cuda_initialized() -> bool:
    """Whether this (parent) process has initialised CUDA; asserted False by the tests (stages then fork)."""
    import torch

    return bool(torch.cuda.is_initialized())


def allot(box: float, later: float, remaining: float) -> float:
    """A stage's box: its own plus whatever the earlier stages left unused (``remaining - later``), never less than
    its own unless the budget is short, then a share of what remains in proportion to the boxes."""
    if remaining <= 0:
        return 0.0
    return max(min(box, remaining), remaining - later) if remaining >= box + later else remaining * box / (box + later)


if __name__ == "__main__":
    raise SystemExit(main())
