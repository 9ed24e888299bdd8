"""Round-3d VLM families exact under packing (issue 39): MiniCPM-V 4.6.

Each family gets the proof of the families before it (tests/test_vlm_families.py, whose harness runs here): the edge
micro-batch (system prompts, a one-word answer, an image inside an assistant turn, text-only, images of different
sizes, a multi-image sample) packed through ``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE
through the stock transformers model (``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses
within the measured fp32 noise floor, the model's own loss equal to the per-sample token mean, gradients within
``GRAD_REL_L2`` (tests/tolerance.py). Each rule has a corruption that must break the comparison. Token-budget plans
equal the processor's lengths in tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``,
these included).

Substituted (no hub here): see ``vlm_pack/testing/tiny_families_round3d.py`` per family.
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")

ROUND3D = ["minicpmv4_6"]


@pytest.mark.parametrize("family", ROUND3D)
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


def _joined(samples: list[dict], order: list[int]) -> dict:
    """The samples' vision tensors joined in ``order`` as the family's rule joins them (pixel columns along the
    width, slice rows along dim 0)."""
    joined = {}
    for key in ("pixel_values", "target_sizes"):
        chunks = [samples[i][key] for i in order if key in samples[i]]
        joined[key] = torch.cat(chunks, dim=-1 if key == "pixel_values" else 0)
    return joined


@torch.no_grad()
def test_corruption_minicpm_slices_follow_their_sample():
    """MiniCPM-V's processor packs every slice of every image of a call into ONE pixel_values row along the width,
    with one target_sizes row per slice. The collator gives each sample its columns (16 per image token) and slice
    rows, and joins them along the width in sample order: the edge batch's images include sliced ones (more slice
    rows than images). Caught: two same-size images' columns and slices swapped between samples, and the samples'
    row split along dim 0 (the default rule: one row for the whole batch cannot be split per sample, and the model reads
    pixel_values[:1] only, so one sample's row alone fails)."""
    import dataclasses

    setup = families.setup_for("minicpmv4_6")
    examples = families.swap_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["pixel_values"].shape[0] == 1
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))

    samples = setup.collator._encode_all(examples)[0]
    assert torch.equal(_joined(samples, [0, 1, 2, 3])["pixel_values"], batch["pixel_values"])
    swapped = {**batch, **_joined(samples, [2, 1, 0, 3])}
    assert swapped["pixel_values"].shape == batch["pixel_values"].shape
    assert refs[3].logits.is_far(families.logit_error(batch, families.packed_logits(setup.packed, swapped), refs))

    one_row = {**batch, "pixel_values": samples[0]["pixel_values"]}  # what a row rule along dim 0 hands the model
    with pytest.raises(RuntimeError, match="must match"):  # the batch's slices are not in that row
        families.packed_logits(setup.packed, one_row)
    rowwise = families.VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config)
    rowwise.family = dataclasses.replace(rowwise.family, width_packed=())
    with pytest.raises(ValueError, match="processor output 'pixel_values'"):  # one row: not split per sample
        rowwise(examples)


def test_minicpm_edge_batch_holds_sliced_images():
    """The edge batch (images of different sizes, one sample with several) exercises the slice rule: some of its
    images become a source image plus slices, each slice its own target_sizes row and image-token run."""
    from vlm_pack.testing.data import photo_examples

    setup = families.setup_for("minicpmv4_6")
    examples = families.edge_examples() + photo_examples(2, seed=3, max_side=140)
    batch = setup.collator(examples)
    images = sum(part.get("type") == "image" for example in examples for turn in example["messages"]
                 if isinstance(turn["content"], list) for part in turn["content"])
    assert batch["target_sizes"].shape[0] > images
    tokens = int((batch["input_ids"] == setup.processor.image_token_id).sum())
    assert batch["pixel_values"].shape[-1] == 16 * 7 * tokens
    assert batch["vlm_pack"]["stats"].image_tokens == tokens


@torch.no_grad()
def test_corruption_minicpm_deltanet_state_carried_across_samples(monkeypatch):
    """The language model's Gated DeltaNet layers restart their conv window and recurrent state per sample
    (enable_packing installs the boundary-aware forward on its Qwen3_5GatedDeltaNet modules): both run over the
    whole row (boundaries ignored) are caught. (The stock layers refuse a packed row outright without
    flash-linear-attention.)"""
    from vlm_pack.attention import gated_deltanet as gd
    from vlm_pack.attention import linear as la

    setup = families.setup_for("minicpmv4_6")
    nets = [m for m in setup.packed.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert nets and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in nets)
    examples = families.edge_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))
    rule, conv, total = gd.segmented_gated_delta_rule, la.segmented_causal_conv1d, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(q, k, v, g, beta, layout):
        return rule(q, k, v, g, beta, whole_row)

    def leaky(hidden_states, weight, bias, activation, layout):
        return conv(hidden_states, weight, bias, activation, whole_row)

    monkeypatch.setattr(gd, "segmented_gated_delta_rule", carried)
    monkeypatch.setattr(la, "segmented_causal_conv1d", leaky)
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("whole-row DeltaNet logit error", error, refs[3].logits.tolerance)
    assert refs[3].logits.is_far(error)


@pytest.mark.parametrize("family", ROUND3D)
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


def test_minicpm_unproven_language_model_is_refused():
    """MiniCPM-V 4.6 is proven with Qwen3.5's hybrid text model only: another language model is refused by name."""
    from transformers import GPT2Config

    from vlm_pack.models import UnsupportedModelError, get_family

    config = families.setup_for("minicpmv4_6").packed.config
    config = config.__class__.from_dict(config.to_dict())
    config.text_config = GPT2Config()
    with pytest.raises(UnsupportedModelError, match=r"minicpmv4_6 model with language model 'gpt2' \(proven"):
        get_family(config)
