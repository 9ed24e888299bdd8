"""FastVLM (timm FastViT-MCi tower with BatchNorm, Qwen2 text) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/fast_vlm.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_families import tiny_vlm

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import (
    assert_exact, assert_packed_exact, edge_examples, errors, logit_error, packed_logits, references, setup_for,
    swap_examples,
)
pytest.importorskip("timm")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["fast_vlm"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["fast_vlm"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["fast_vlm"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


@torch.no_grad()
def test_fast_vlm_training_batch_norm_is_refused_and_freeze_batch_norm_is_exact():
    """A packed row through the tower with its BatchNorm layers in training mode is refused by name (they would mix
    the samples' images: measured far from each sample alone); after freeze_batch_norm, model.train() keeps them on
    their running statistics and the packed row is exact again."""
    from vlm_pack.models.fast_vlm import freeze_batch_norm

    setup = setup_for("fast_vlm")
    examples = swap_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    model = enable_packing(tiny_vlm("fast_vlm", setup.processor)).train()
    with pytest.raises(ValueError, match="BatchNorm layers in training mode"):
        packed_logits(model, batch)
    mixed = packed_logits(setup.stock.train(), batch)  # what the refused row would compute (stock, batch stats)
    setup.stock.eval()
    assert refs[3].logits.is_far(logit_error(batch, mixed, refs))
    freeze_batch_norm(model).train()
    assert_exact(errors(batch, packed_logits(model, batch), refs))
