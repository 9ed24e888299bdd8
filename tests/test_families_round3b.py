"""Round-3b VLM families exact under packing (issue 39): PaddleOCR-VL, ...

Each family gets the proof of the families before it (tests/test_vlm_families.py, whose harness runs here): the edge
micro-batch (system prompts, a one-word answer, an image inside an assistant turn, text-only, images of different
sizes, a multi-image sample) packed through ``enable_packing`` + ``VLMPackingCollator``, with context-parallel
alignment slots where the family allows them, against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py). Each rule
has a corruption that must break the comparison (vision rows given to the wrong sample, positions not restarted, and
the family's own position rule dropped). Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``, these included).

Substituted (no hub here): see ``vlm_pack/testing/tiny_families_round3b.py`` per family.
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")

ROUND3B = ["paddleocr_vl"]
MROPE = ["paddleocr_vl"]


@pytest.mark.parametrize("family", ROUND3B)
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ROUND3B)
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", MROPE)
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", ROUND3B)
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)
