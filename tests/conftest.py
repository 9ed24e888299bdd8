"""Fixtures shared by the collator and VLM exactness tests, and the Hypothesis settings profile.

Imports happen inside the fixtures, so test files that need none of this (packing, attention, ...) do not pay
for loading transformers.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

# Property tests are derandomized by default (the same examples on every run and machine: a CI failure
# reproduces locally, and a pass is not luck of the draw), without a deadline (a loaded 2-core CI box) and
# without an example database. `HYPOTHESIS_PROFILE=explore pytest ...` searches fresh random examples.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=50)
settings.register_profile("explore", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# `pytest -n 2` runs one worker per core: each keeps ONE intra-op thread, because two workers with torch's default
# thread count oversubscribe the cores (tests/test_trainer.py: 145 s -> 80 s wall). Subprocesses inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
        sys.modules["torch"].set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A family or feature that vlm_pack refuses on this transformers (``UnsupportedVersionError``: proven only on
    later releases, vlm_pack.core.versions) is a skip naming the release, not a failure: the floor check
    (scripts/check_floors.sh) lists them. Each refusal itself is asserted by a test of its own."""
    outcome = yield
    report = outcome.get_result()
    models = sys.modules.get("vlm_pack.models")
    if report.failed and call.excinfo is not None and models is not None and call.excinfo.errisinstance(
            models.UnsupportedVersionError):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


@pytest.fixture(scope="session")
def processor():
    """The offline Qwen2-VL processor (real Qwen tokenizer + image processor); built once, never mutated."""
    from vlm_pack.testing.tiny_models import offline_qwen2vl_processor

    return offline_qwen2vl_processor()


@pytest.fixture(scope="module")
def qwen2_config():
    """A fresh tiny Qwen2-VL config, one per test module."""
    from vlm_pack.testing.tiny_models import tiny_config

    return tiny_config("qwen2_vl")


@pytest.fixture(scope="module")
def collator(processor, qwen2_config):
    """The default packing collator for Qwen2-VL (max_length 512), one per test module."""
    from vlm_pack.data.collator import VLMPackingCollator

    return VLMPackingCollator(processor, max_length=512, model_config=qwen2_config)


@pytest.fixture(scope="session")
def aligned_packs(tmp_path_factory):
    """The shipped SFT sample prepared once at pack size 128 with every sample aligned to a multiple of 4 (and a
    validation split): ``{"training": path, "validation": path, "metadata": path}``."""
    from pathlib import Path

    from vlm_pack.offline import prepare_packed_sequence_data
    from vlm_pack.testing.tiny_models import qwen_tokenizer_path

    source = Path(__file__).resolve().parents[1] / "examples" / "data" / "sft_sample.jsonl"
    written = prepare_packed_sequence_data(
        source, str(qwen_tokenizer_path()), tmp_path_factory.mktemp("aligned"), [128], pad_seq_to_mult=4,
        validation_fraction=0.25, max_seq_length=128, progress=False, log=lambda line: None)
    paths = {split.split: split.path for split in written}
    return {**paths, "metadata": paths["training"].parent / "128_metadata.jsonl"}


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module (exactness tests compare float sums; 2 threads only add contention)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def boundaries_dropped(monkeypatch):
    """Corruption: the packed attention sees the whole row as ONE segment (sample boundaries ignored)."""
    import torch

    import vlm_pack.integrations.hf_model as hf

    original = hf.varlen_attention

    def one_segment(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return original(q, k, v, whole, whole, q.shape[0], q.shape[0], **kwargs)

    monkeypatch.setattr(hf, "varlen_attention", one_segment)
