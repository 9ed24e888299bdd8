"""Mistral 4 (MLA + MoE text, YaRN + Llama-4 scaling) inside a Mistral3 VLM exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/mistral3.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["mistral4"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["mistral4"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["mistral4"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


def test_mistral3_accepts_yarn_for_a_mistral4_language_model_only():
    """YaRN is proven for Mistral 4's language model (its edge batch above runs YaRN + Llama-4 scaling past their
    original context); a Mistral (v1) language model with YaRN is still refused, by that family's own check."""
    from vlm_pack.models import UnsupportedModelError, get_family

    config = families.setup_for("mistral4").packed.config
    assert config.text_config.rope_parameters["rope_type"] == "yarn"
    assert get_family(config).name == "mistral3"
    mistral = families.setup_for("mistral3").packed.config
    mistral = mistral.__class__.from_dict(mistral.to_dict())
    mistral.text_config.rope_parameters = {**config.text_config.rope_parameters}
    with pytest.raises(UnsupportedModelError, match=r"language model 'mistral' with rope_type \['yarn'\]"):
        get_family(mistral)
