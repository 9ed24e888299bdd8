"""VideoLLaMA 3 (NaViT SigLIP tower + Qwen2 text) exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/video_llama_3.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["video_llama_3"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["video_llama_3"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["video_llama_3"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@pytest.mark.parametrize("family", ["video_llama_3"])
def test_unproven_language_model_is_refused(family):
    """Any language model but its proven text family, or that family with an unhandled feature (sliding layers),
    is refused by name (the harness's check)."""
    families.test_unproven_language_model_is_refused(family)
