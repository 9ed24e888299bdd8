"""Phi-4-multimodal (longrope text) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/phi4_multimodal.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import (
    Setup, assert_packed_exact, edge_examples, exact_batch, logit_error, packed_logits, setup_for, swap_examples,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["phi4_multimodal"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["phi4_multimodal"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not; not for the harness's
    PACKED_LAYOUT_FAMILIES, Mllama)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["phi4_multimodal"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


def _short_chat() -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}


def test_phi4_multimodal_longrope_long_factors_exact_and_mixed_rows_refused():
    """With original_max_position_embeddings=64, image samples (~290 tokens) use longrope's long factors alone: packed
    together they are exact. A row mixing them with a short sample (short factors alone) is refused, naming the bound;
    audio inputs in a packed row are refused by name."""
    processor = tiny_vlm_processor("phi4_multimodal")
    stock = tiny_vlm("phi4_multimodal", processor, original_max_position_embeddings=64)
    packed = enable_packing(tiny_vlm("phi4_multimodal", processor, original_max_position_embeddings=64))
    collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
    setup = Setup("phi4_multimodal", processor, stock, packed, collator)
    examples = [swap_examples()[0], swap_examples()[2]]
    with torch.no_grad():
        batch, refs = exact_batch(setup, examples)
        short = tiny_vlm("phi4_multimodal", processor)  # original 4096: the short factors differ
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(short, batch), refs))
        mixed = collator([examples[0], _short_chat()])
        with pytest.raises(ValueError, match="original_max_position_embeddings=64"):
            packed_logits(packed, mixed)
        with pytest.raises(ValueError, match="audio packing is not proven"):
            packed_logits(packed, batch, audio_input_features=torch.zeros(1, 8, 80))
