"""The GPU check (benchmarks/gpu/run.sh) works before a GPU is ever borrowed: its dry run goes through every
stage's code on CPU and writes a well-formed report, a crashing or hanging stage is recorded (its traceback dumped)
while the next one runs, a failing route or measurement inside a stage is recorded while the others run, run.sh
installs and probes the carried wheels and keeps the caller's environment (recording fakes), the stages spawn when
the parent has initialised CUDA, and what the device tool carries stays within 56 MiB with installable wheels.
The rehearsal in the image's versions is scripts/check_gpu_rehearsal.sh (too big for CI: torch 2.11 is ~4 GB)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 56
sys.path.insert(0, str(ROOT))
from benchmarks.gpu.check import BUDGET_S, INJECTED, STAGES  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every stage in the running environment (--no-wheels: CI's, whatever .gpu_wheels holds here),
    with the two injected failures first (a crash, a hang past a 1 s box)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--dry-run", "--no-wheels", "--inject-failures",
                          "--box", "injected_hang=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return run, out


def _numbers(value, where="data"):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{where}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield where, value


def test_dry_run_reports_every_stage_ok_or_skipped_with_a_reason(dry_run):
    run, out = dry_run
    assert run.returncode == 1, f"the injected failures must fail the run:\n{run.stdout[-3000:]}"
    results = json.loads((out / "gpu_results.json").read_text())
    stages = {s["name"]: s for s in results["stages"]}
    assert [s["name"] for s in results["stages"]] == [name for name, _, _ in (*INJECTED, *STAGES)]
    assert results["meta"]["dry_run"] is True
    for name, _, _ in STAGES:
        status = stages[name]["status"]
        assert status == "ok" or (status.startswith("skipped: ") and len(status) > len("skipped: ")), (
            f"{name}: {status}\n{run.stdout[-4000:]}")
        bad = [(where, v) for where, v in _numbers(stages[name]["data"]) if not math.isfinite(v)]
        assert not bad and "nan" not in json.dumps(stages[name]["data"]), f"{name}: non-finite numbers {bad}"
        if status == "ok":
            assert stages[name]["data"] and stages[name]["markdown"], name
            assert all(stages[name]["checks"].values()), f"{name}: failed checks {stages[name]['checks']}"
    report = (out / "gpu_report.md").read_text()
    for name, _, _ in STAGES:
        assert f"| {name} | {stages[name]['status']} |" in report
    assert (out / "gpu_run.log").stat().st_size > 0
    assert len(list(out.iterdir())) <= 8, "the device tool brings back at most 8 files"


def test_a_crashing_and_a_hanging_stage_are_recorded_and_the_next_stages_run(dry_run):
    run, out = dry_run
    stages = {s["name"]: s for s in json.loads((out / "gpu_results.json").read_text())["stages"]}
    assert stages["injected_crash"]["status"].startswith("failed: the stage process died (killed by signal SIGABRT)")
    assert stages["injected_hang"]["status"] == "failed: timed out after 1 s (killed; what it had saved is kept)"
    assert stages["injected_hang"]["seconds"] < 10
    assert stages["machine"]["status"] == "ok"  # the first real stage ran after both
    # faulthandler dumped the hanging child's stack (where it hung) before the box killed it
    hang_log = run.stdout.split("=== stage injected_hang")[1].split("=== stage machine")[0]
    assert "Timeout (" in hang_log and "in _run_child" in hang_log, hang_log


def test_the_report_names_the_setup_toolchain_and_attention_per_layout(dry_run):
    run, out = dry_run
    results = json.loads((out / "gpu_results.json").read_text())
    meta, stages = results["meta"], {s["name"]: s for s in results["stages"]}
    assert meta["parent_cuda_initialized"] is False and meta["start_methods"] == "fork"
    assert meta["offline"] == "HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, HF_DATASETS_OFFLINE=1"
    assert all(meta["probe"][group]["ok"] for group in ("torch", "transformers", "vlm_pack")), meta["probe"]
    machine = stages["machine"]["data"]
    assert machine["c_compiler"] and "Python.h" in machine["python_headers"] and "varlen_attn" in machine["varlen_attn"]
    assert any(p.startswith("torch==") for p in machine["packages"]) and "cudnn" in machine["versions (toolchain)"]
    report = (out / "gpu_report.md").read_text()
    assert "C compiler: " in report and "Python headers: " in report and "Deep import probe" in report
    for model in stages["speed"]["data"]["models"]:
        for layout, entry in model["layouts"].items():
            # the packed route (and its GQA handling) and the padded layouts' SDPA backend, named per layout
            want = "varlen sdpa_segments" if layout == "packed" else "sdpa "
            assert want in entry["attention"], (model["model"], layout, entry["attention"])
            assert entry["fwd_bwd_s"] > 0 and entry["optimizer_s"] > 0 and entry["timed_steps"] >= 1
            assert f"- {model['model']} / {layout}: {entry['attention']}" in report
    kernels = stages["kernels"]["data"]
    assert {r["layout"] for r in kernels["errors"]} == {"packed", "window", "blocks+window+softcap", "shared_prefix"}
    assert all(r["repeats"] >= 3 and "spread" in r for r in kernels["speed"])


def _tracked_bytes() -> int:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the carried files are the tracked ones")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / name).stat().st_size for name in listed.decode().split("\0") if name and (ROOT / name).is_file())


def test_the_carry_stays_within_56_mib():
    wheels = sum(path.stat().st_size for path in (ROOT / ".gpu_wheels").glob("*.whl"))
    carry = _tracked_bytes() + wheels
    assert carry <= LIMIT_MIB * 2**20, f"tracked files + .gpu_wheels = {carry / 2**20:.1f} MiB > {LIMIT_MIB} MiB"


def test_wheels_script_prints_the_sizes_and_the_carry():
    _tracked_bytes()
    run = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "flash-attn: no binary wheel on PyPI" in run.stdout
    assert f"(limit {LIMIT_MIB} MiB)" in run.stdout and "= carry " in run.stdout
    assert "/.gpu_wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_kernel_and_exactness_checks_fail_when_packing_ignores_boundaries(monkeypatch):
    """Corruption: a varlen route that treats the whole row as one sample must fail both stages' checks (the dry
    run's passing checks are then evidence, not a tautology)."""
    import torch

    from benchmarks.gpu import exactness, kernels
    from benchmarks.gpu.common import Context
    from vlm_pack.attention import varlen
    from vlm_pack.integrations import hf_model

    real = varlen.varlen_attention

    def one_segment(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        whole = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
        return real(q, k, v, whole(q.shape[0]), whole(k.shape[0]), q.shape[0], k.shape[0], **kwargs)

    monkeypatch.setattr(kernels, "varlen_attention", one_segment)
    monkeypatch.setattr(hf_model, "varlen_attention", one_segment)
    monkeypatch.setattr(kernels, "_gpu_tests", lambda ctx: {"status": "not run"})
    context = Context(dry=True, device="cpu")
    kernel_checks, exact_checks = kernels.run(context).checks, exactness.run(context).checks
    assert kernel_checks and not any(kernel_checks.values()), kernel_checks
    assert not any(ok for name, ok in exact_checks.items() if "fp32" in name), exact_checks


def test_the_time_boxes_fit_one_540_s_call_and_the_docs_list_them():
    # the boxes + the wheel install, deep probe and parent imports (~35 s measured on 2 CPUs at load 10) fit the budget,
    # and the budget fits the device tool's 540 s call with room for run.sh's last report write
    assert sum(box for _, _, box in STAGES) + 40 <= BUDGET_S <= 540 - 10
    rows = [line.split("|") for line in (ROOT / "docs" / "gpu_check.md").read_text().splitlines()
            if line.startswith("| ") and line[2:4] in {f"{c}." for c in "abcdefg"}]
    assert [int(row[2]) for row in rows] == [box for _, _, box in STAGES]


def test_a_box_gets_the_time_earlier_stages_left_but_never_a_later_stage_s():
    from benchmarks.gpu.check import allot

    assert allot(100, later=200, remaining=400) == 200  # 100 s left unused earlier flows into this stage
    assert allot(100, later=200, remaining=300) == 100
    assert allot(100, later=200, remaining=150) == 50  # short budget: shared in proportion to the boxes
    assert allot(100, later=0, remaining=-1) == 0


def test_stages_spawn_when_the_parent_has_initialised_cuda(monkeypatch):
    """A forked child of a CUDA parent cannot use CUDA: with torch.cuda.is_initialized() True in the parent (a
    recording fake) the stage starts with spawn and a crash is still recorded."""
    import torch

    from benchmarks.gpu import check

    assert check.start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    record = check.run_stage("injected_crash", None, 60, True, "cpu")
    assert record["start_method"] == "spawn"
    assert record["status"].startswith("failed: the stage process died (killed by signal SIGABRT)"), record


def test_a_failing_route_is_recorded_and_every_other_measurement_runs(monkeypatch):
    """Recording fake: the varlen call fails whenever a window is asked for; the window and image layouts record
    the error (and fail their check) while the packed and shared-prefix rows and the packed speed rows are measured."""
    from benchmarks.gpu import kernels
    from benchmarks.gpu.common import Context

    real = kernels.varlen_attention

    def no_window(*args, **kwargs):
        if kwargs.get("window") is not None:
            raise RuntimeError("injected: window kernel failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "varlen_attention", no_window)
    result = kernels.run(Context(dry=True, device="cpu"))
    rows = {(r["layout"], r["route"]): r for r in result.data["errors"]}
    assert "injected: window kernel failed" in rows[("window", "sdpa_segments")]["error"]
    assert "injected" in rows[("blocks+window+softcap", "sdpa_segments")]["error"]
    assert "error" not in rows[("packed", "sdpa_segments")] and "error" not in rows[("shared_prefix", "sdpa_segments")]
    assert result.checks["window/sdpa_segments ran"] is False
    assert result.checks["packed/sdpa_segments within 4x plain bf16 math's error"] is True
    speed = {r["layout"]: r for r in result.data["speed"]}
    assert speed["packed"]["ms"] > 0 and "injected" in speed["blocks+window+softcap"]["error"]


def test_speed_times_a_native_gqa_route_when_auto_repeats_kv_heads(monkeypatch):
    """Recording fake: when the packed route repeats KV heads (torch_varlen on torch 2.11), the speed stage also
    times the same rows through the alternative route, forced, and reports both."""
    from benchmarks.gpu import speed
    from benchmarks.gpu.common import Context

    monkeypatch.setattr(speed, "kv_repeat", lambda route, heads, kv_heads: heads // kv_heads)
    result = speed.measure_model("text", Context(dry=True, device="cpu"), speed._settings(Context(True, "cpu")),
                                 lambda partial: None)
    alt = result["layouts"]["packed via sdpa_segments"]
    assert alt["timed_steps"] >= 1 and alt["tokens_per_s"] > 0 and "repeated 2x" in alt["attention"]
    assert result["layouts"]["padded"]["micro_batches"] >= 1 and result["best_packed"].startswith("packed")


def _fake_wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = (),
                tags: str = "py3-none-any") -> Path:
    import zipfile

    path = folder / f"{name}-{version}-{tags}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for inner, text in files.items():
            archive.writestr(inner, text)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s" % (
            name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)))
        archive.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tags}\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


def _recording_python(tmp_path: Path, fail_probe_with: str | None = None) -> tuple[Path, Path]:
    """A PYTHON for run.sh: pip goes to the real interpreter; the probe and check.py calls are recorded (argv,
    environment, whether the carried module imports) instead of run. ``fail_probe_with``: the probe fails while a
    module of that name is on the carried site."""
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ] || [ "$1" != "-m" ] && [ "$2" != "-m" ]; then exec {sys.executable} "$@"; fi
{sys.executable} - "$@" <<'PY'
import json, os, sys, importlib.util
argv = sys.argv[1:]
site = os.environ["PYTHONPATH"].split(":")[0]
carried = os.path.isdir(os.path.join(site, "vlm_pack_fake_carried"))
with open({str(log)!r}, "a") as handle:
    handle.write(json.dumps({{"argv": argv, "env": {{k: os.environ.get(k) for k in ("PYTHONPATH", "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "PYTHONUNBUFFERED", "GPU_CHECK_WHEELS", "GPU_CHECK_PROBE")}},
        "carried": carried, "transformers_on_site": os.path.isdir(os.path.join(site, "transformers"))}}) + "\\n")
fail = {fail_probe_with!r}
sys.exit(1 if "benchmarks.gpu.probe" in argv and fail and os.path.isdir(os.path.join(site, fail)) else 0)
PY
""")
    script.chmod(0o755)
    return script, log


def _run_sh(tmp_path: Path, wheels: Path, python: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python), "GPU_CHECK_WHEEL_DIR": str(wheels),
           "PYTHONPATH": "/caller/path"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "PYTHONUNBUFFERED"):
        env.pop(name, None)
    return subprocess.run(["bash", "benchmarks/gpu/run.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_run_sh_dry_run_installs_and_probes_the_carried_wheels_and_keeps_the_environment(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "vlm_pack_fake_carried", "1.0", {"vlm_pack_fake_carried/__init__.py": "X = 1\n"})
    python, log = _recording_python(tmp_path)
    run = _run_sh(tmp_path, wheels, python)
    assert run.returncode == 0, run.stdout + run.stderr
    probe, check = [json.loads(line) for line in log.read_text().splitlines()]
    assert probe["argv"][:2] == ["-m", "benchmarks.gpu.probe"] and probe["carried"]
    assert check["argv"][:3] == ["-u", "-m", "benchmarks.gpu.check"] and "--dry-run" in check["argv"]
    assert check["carried"], "the dry run must install the carried wheels, as the GPU run does"
    site, root, caller = check["env"]["PYTHONPATH"].split(":")
    assert (root, caller) == (str(ROOT), "/caller/path") and site.startswith(os.environ.get("TMPDIR", "/tmp"))
    assert all(check["env"][k] == "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
                                                "PYTHONUNBUFFERED"))
    assert check["env"]["GPU_CHECK_WHEELS"] == "vlm_pack_fake_carried-1.0"
    assert not Path(site).exists(), "the temporary site folder is removed at the end"


def test_run_sh_drops_a_carried_transformers_that_fails_the_deep_probe(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "transformers", "9.9", {"transformers/__init__.py": "raise ImportError('broken')\n"})
    _fake_wheel(wheels, "vlm_pack_fake_carried", "1.0", {"vlm_pack_fake_carried/__init__.py": ""})
    python, log = _recording_python(tmp_path, fail_probe_with="transformers")
    run = _run_sh(tmp_path, wheels, python)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["argv"][1 if c["argv"][0] == "-m" else 2] for c in calls] == [
        "benchmarks.gpu.probe", "benchmarks.gpu.probe", "benchmarks.gpu.check"], run.stdout
    assert calls[0]["transformers_on_site"] and not calls[1]["transformers_on_site"] and calls[2]["carried"]
    assert "transformers + huggingface_hub wheels dropped" in calls[2]["env"]["GPU_CHECK_WHEELS"]


def test_wheels_check_refuses_a_wheel_the_image_cannot_install_or_a_disagreeing_set(tmp_path):
    _tracked_bytes()
    for case, wheels in (("tags", [("native", "1.0", (), "cp311-cp311-manylinux2014_x86_64")]),
                         ("requirements", [("alpha", "1.0", ("beta>=2",), "py3-none-any"),
                                           ("beta", "1.5", (), "py3-none-any")])):
        folder = tmp_path / case
        folder.mkdir()
        for name, version, requires, tags in wheels:
            _fake_wheel(folder, name, version, {f"{name}/__init__.py": ""}, requires, tags)
        run = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "GPU_CHECK_WHEEL_DIR": str(folder)})
        assert run.returncode == 1, (case, run.stdout)
        assert ("cp311-cp311" in run.stdout) if case == "tags" else ("needs beta>=2 but beta 1.5" in run.stdout)
    folder = tmp_path / "fine"  # the stable ABI of an older CPython (hf-xet's cp38-abi3) installs on 3.12
    folder.mkdir()
    _fake_wheel(folder, "stable", "1.0", {"stable/__init__.py": ""}, (), "cp38-abi3-manylinux2014_x86_64")
    _fake_wheel(folder, "pure", "1.0", {"pure/__init__.py": ""}, ("stable>=1",), "py3-none-any")
    run = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "GPU_CHECK_WHEEL_DIR": str(folder)})
    assert run.returncode == 0, run.stdout + run.stderr
