"""Round-4 families exact under packing (issue 47).

Each family gets the proof of the families before it (tests/test_vlm_families.py, whose harness runs here): the edge
micro-batch (system prompts, a one-word answer, an image inside an assistant turn, text-only, images of different
sizes, a multi-image sample; audio where the family takes it) packed through ``enable_packing`` +
``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py). Each rule
has a corruption that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``, these included).

Substituted (no hub here): see ``vlm_pack/testing/tiny_families_round4.py`` per family.
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")

ROUND4 = ["video_llama_3"]


@pytest.mark.parametrize("family", ROUND4)
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ROUND4)
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@pytest.mark.parametrize("family", ROUND4)
def test_corruptions_are_caught(family):
    """Vision rows swapped between two samples with same-size images, and positions not restarted per sample (stock
    sdpa reading boundaries from position ids), each break the comparison the clean batch passes."""
    families.test_corruptions_are_caught(family)
