"""HyperCLOVA X Vision V2 (Qwen2.5-VL windowed tower + HyperCLOVA X MuP text) exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/hyperclovax_vision_v2.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["hyperclovax_vision_v2"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["hyperclovax_vision_v2"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["hyperclovax_vision_v2"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_hyperclovax_logit_scaling_is_applied_in_the_chunked_loss(monkeypatch):
    """The model multiplies its logits by logits_scaling (4 here): the chunked training loss applies it (equal to
    the per-sample token mean) and dropping it is caught."""
    from vlm_pack.integrations.hf_model import enable_packing
    from vlm_pack.testing.tiny_families import tiny_vlm

    setup = families.setup_for("hyperclovax_vision_v2")
    examples = families.edge_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    token_mean = sum(loss * n for loss, n in zip(refs[1], refs[2])) / sum(refs[2])
    chunked = enable_packing(tiny_vlm("hyperclovax_vision_v2", setup.processor)).train()
    assert chunked._vlm_pack_logit_transform == {"scale": 4.0, "softcap": None}
    refs[3].loss.check((chunked(**batch).loss - token_mean).abs().item(), "the chunked training loss")
    monkeypatch.setattr(chunked, "_vlm_pack_logit_transform", {"scale": None, "softcap": None})
    assert refs[3].loss.is_far((chunked(**batch).loss - token_mean).abs().item()), "logit scaling dropped"
