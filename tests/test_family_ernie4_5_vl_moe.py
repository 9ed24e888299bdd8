"""ERNIE 4.5 VL MoE (3-D rope, text and vision experts; one processor call per sample) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/ernie4_5_vl_moe.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["ernie4_5_vl_moe"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["ernie4_5_vl_moe"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["ernie4_5_vl_moe"])
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", ["ernie4_5_vl_moe"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_corruption_ernie_vision_experts_follow_their_tokens():
    """ERNIE 4.5 VL routes the tokens marked in moe_mm_token_type_ids (image tokens and their markers) to its vision
    experts: the per-token key is packed like input_ids; the marks dropped (every token to the text experts) are
    caught."""
    setup = families.setup_for("ernie4_5_vl_moe")
    examples = families.swap_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["moe_mm_token_type_ids"].shape == batch["input_ids"].shape and batch["moe_mm_token_type_ids"].any()
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))
    unmarked = torch.zeros_like(batch["moe_mm_token_type_ids"])
    assert refs[3].logits.is_far(families.logit_error(
        batch, families.packed_logits(setup.packed, batch, moe_mm_token_type_ids=unmarked), refs))


def test_ernie_processor_is_called_once_per_sample():
    """ERNIE's processor builds its MoE token types with np.array over the batch's ids, so a batch of samples of
    different lengths fails in one call; the family's encode_alone makes the collator call it per sample."""
    import dataclasses

    from vlm_pack.data.collator import VLMPackingCollator

    setup = families.setup_for("ernie4_5_vl_moe")
    examples = families.mixed_examples(3, seed=1)
    collator = VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config)
    assert collator(examples)["cu_seq_lens_q"].numel() == 4
    collator.encoding = dataclasses.replace(collator.encoding, encode_alone=False)
    with pytest.raises(ValueError, match="inhomogeneous"):
        collator(examples)
