"""LFM3-VL (conv + attention NaViT tower, LFM3 conv / sliding / full text) exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/lfm3_vl.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["lfm3_vl"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["lfm3_vl"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["lfm3_vl"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_lfm3_vl_each_rule_is_needed(monkeypatch):
    """LFM3's short-convolution layers restart their window per sample (enable_packing installs the boundary-aware
    forward on its Lfm3ShortConv modules) and its sliding layers keep their window: the conv window carried over the
    whole row (boundaries ignored) and the sliding window dropped are each caught."""
    from vlm_pack.attention import linear as la
    from vlm_pack.integrations import hf_model

    setup = families.setup_for("lfm3_vl")
    convs = [m for m in setup.packed.modules() if type(m).__name__ == "Lfm3ShortConv"]
    assert convs and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in convs)
    examples = families.edge_examples()
    batch, refs = families.exact_batch(setup, examples)
    window = setup.packed.config.text_config.sliding_window
    assert max(families.packing_metadata(batch)["seq_lengths"].tolist()) > window
    plain = hf_model.varlen_attention
    monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("lfm3_vl window dropped", error)
    assert refs[3].logits.is_far(error)
    monkeypatch.undo()
    exact, total = la.segmented_causal_conv1d, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(hidden_states, weight, bias, activation, layout):
        return exact(hidden_states, weight, bias, activation, whole_row)

    monkeypatch.setattr(la, "segmented_causal_conv1d", carried)
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("lfm3_vl conv window carried", error)
    assert refs[3].logits.is_far(error)
