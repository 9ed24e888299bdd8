"""Mllama (Llama 3.2 Vision: per-sample cross-attention) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/mllama.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.attention.cross import CROSS_KEYS_KWARG as CROSS_KEYS
from vlm_pack.data.collator import VLMPackingCollator

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import assert_packed_exact, edge_examples, exact_batch, logit_error, packed_logits, setup_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["mllama"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["mllama"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not; not for the harness's
    PACKED_LAYOUT_FAMILIES, Mllama)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["mllama"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


@torch.no_grad()
def test_mllama_cross_attention_follows_the_packed_samples(monkeypatch):
    """Cross-attention must keep each sample's text on its own images: all images of the row visible to every
    sample (one key segment), or the processor's mask spans running to the row's end (the processor's rule applied to
    the concatenated text), are caught. The layout hook is what makes the packed batch exact."""
    from vlm_pack.attention.cross import CrossKeys
    from vlm_pack.models import mllama

    setup = setup_for("mllama")
    batch, refs = exact_batch(setup, edge_examples())
    exact = mllama.packed_image_inputs

    def one_segment(kwargs, image_token_id):
        inputs = exact(kwargs, image_token_id)
        counts = inputs[CROSS_KEYS].items_per_segment
        inputs[CROSS_KEYS] = CrossKeys([sum(counts)] + [0] * (len(counts) - 1))
        return inputs

    def row_spans(kwargs, image_token_id):
        total = kwargs["input_ids"].shape[1]
        inputs = exact({**kwargs, "cu_seq_lens_q": torch.tensor([0, total])}, image_token_id)
        return {**inputs, CROSS_KEYS: exact(kwargs, image_token_id)[CROSS_KEYS]}

    for corrupt in (one_segment, row_spans):
        monkeypatch.setattr(mllama, "packed_image_inputs", corrupt)
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))


def test_mllama_refuses_context_parallelism():
    setup = setup_for("mllama")
    with pytest.raises(ValueError, match="cross-attention segments are not split"):
        VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                           context_parallel_size=2)
