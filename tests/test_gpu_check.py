"""The GPU check (benchmarks/gpu/run.sh) works before a GPU is ever borrowed: its dry run goes through every
stage's code on CPU and writes a well-formed report, a crashing or hanging stage is recorded while the next one
runs, and what the device tool carries (tracked files + the wheels of scripts/gpu_wheels.sh) stays within 56 MiB."""

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
from benchmarks.gpu.check import INJECTED, STAGES  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every stage, with the two injected failures first (a crash, a hang past a 1 s box)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--dry-run", "--inject-failures"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
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


def test_the_time_boxes_fit_an_8_minute_run_and_the_docs_list_them():
    # 30 s for the wheel install, the imports and the CUDA start-ups on top of the boxes
    assert sum(box for _, _, box in STAGES) + 30 <= 8 * 60
    rows = [line.split("|") for line in (ROOT / "docs" / "gpu_check.md").read_text().splitlines()
            if line.startswith("| ") and line[2:4] in {f"{c}." for c in "abcdefg"}]
    assert [int(row[2]) for row in rows] == [box for _, _, box in STAGES]
