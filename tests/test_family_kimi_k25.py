"""Kimi K2.5 (MoonViT-style tower + DeepSeek-V3 MLA / MoE / YaRN text) exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/kimi_k25.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["kimi_k25"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["kimi_k25"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["kimi_k25"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


def test_kimi_k25_unproven_language_model_is_refused():
    """Kimi K2.5 is proven with a DeepSeek-V3 language model only: another one is refused by name, and so is
    DeepSeek-V3 with a feature its family does not handle (length-dependent RoPE)."""
    from transformers import GPT2Config

    from vlm_pack.models import UnsupportedModelError, get_family

    config = families.setup_for("kimi_k25").packed.config
    config = config.__class__.from_dict(config.to_dict())
    text = config.text_config
    config.text_config = GPT2Config()
    with pytest.raises(UnsupportedModelError, match=r"kimi_k25 model with language model 'gpt2' \(proven"):
        get_family(config)
    config.text_config = text
    text.rope_parameters = {**text.rope_parameters, "rope_type": "dynamic"}
    with pytest.raises(UnsupportedModelError, match=r"language model 'deepseek_v3' with rope_type \['dynamic'\]"):
        get_family(config)
