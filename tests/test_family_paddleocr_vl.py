"""PaddleOCR-VL (NaViT SigLIP + ERNIE-4.5 text, 3-D rope) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/paddleocr_vl.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["paddleocr_vl"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["paddleocr_vl"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["paddleocr_vl"])
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", ["paddleocr_vl"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)
