"""MiniCPM-V 4.6 (NaViT slices, Qwen3.5 hybrid text) and 4.7 (4.6 positioned by Canvas M-RoPE) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

MiniCPM-V 4.7's reference is the stock sdpa model, which lays out each sample's canvas itself.

Tiny models and offline processors: ``vlm_pack/testing/families/minicpmv.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator

import test_vlm_families as families

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


@pytest.mark.parametrize("family", ["minicpmv4_6"])
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
    rowwise.encoding = dataclasses.replace(rowwise.encoding, vision=dataclasses.replace(rowwise.encoding.vision, width_packed=()))
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


@pytest.mark.parametrize("family", ["minicpmv4_6"])
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


def _photos(*sizes: tuple[int, int]) -> dict:
    """One sample holding a shipped photo at each (width, height): 140 x 105 gives a source image plus a 2 x 2 grid
    of slices (a newline between the slice rows), 56 x 28 / 28 x 56 unsliced images of 4 x 12 / 12 x 4 patches."""
    from vlm_pack.testing.data import sample_photos

    pictures = list(sample_photos(140).values())
    content = [{"type": "image", "image": pictures[i].resize(size)} for i, size in enumerate(sizes)]
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": f"{len(sizes)} photos."}]}


def _canvas_examples() -> list[dict]:
    """Two samples holding a wide and a tall photo in opposite orders (the same pixel width: swappable; the same
    token counts, other canvases), a text-only chat and a sliced photo."""
    from vlm_pack.testing.data import text_chat_examples

    return [_photos((56, 28), (28, 56)), text_chat_examples(1, seed=0, max_turns=1)[0], _photos((28, 56), (56, 28)),
            _photos((140, 105))]


def test_minicpmv4_7_packed_equals_each_sample_alone():
    """Logits, per-sample losses, the model's own loss and gradients vs each sample alone through the stock sdpa
    model, whose forward lays out each sample's canvas itself (compute_3d_position_ids); the batch holds sliced
    images whose slices span several rows (newlines inside the canvas) and a text-only sample (1-D positions)."""
    setup = families.setup_for("minicpmv4_7")
    examples = families.edge_examples() + [_photos((140, 105))]
    batch = setup.collator(examples)
    newline = setup.stock.config.newline_id
    in_canvas = (batch["input_ids"] == newline) & (batch["position_ids"][1] != batch["position_ids"][0])
    assert batch["target_sizes"].shape[0] > batch["vlm_pack"]["stats"].images and in_canvas.any()
    nets = [m for m in setup.packed.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert nets and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in nets)  # restarted per sample
    result = families.compare(setup, examples)
    print("minicpmv4_7", result)
    families.assert_exact(result)


@torch.no_grad()
def test_minicpmv4_7_canvas_per_sample_and_slices_per_sample_are_each_needed():
    """Caught: a sample's canvas laid out from the batch's slice sizes instead of its own (the rope index run per
    sample but handed every sample's target_sizes: sample 2 then reads sample 0's grids), 1-D
    positions (no canvas: what allow_unproven would give), and two same-size images' pixel columns and slice rows
    swapped between samples (MiniCPM-V 4.6's one-row rule). Not a corruption: the canvas laid out over the whole
    packed row, whose rotary positions are each sample's own plus one constant per sample (asserted), which rotary
    attention inside a sample cannot see (the per-sample layout is kept: it is what the model computes alone)."""
    from vlm_pack.core.batch import packing_metadata

    setup = families.setup_for("minicpmv4_7")
    examples = _canvas_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    samples = setup.collator._encode_all(examples)[0]
    meta = packing_metadata(batch)
    spans = list(zip(meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist()))
    index = setup.collator.rope_index
    batch_grids = batch["position_ids"].clone()
    (start, length), ids = spans[2], samples[2]["input_ids"]
    batch_grids[:, :, start:start + length] = index(ids, samples[2]["mm_token_type_ids"], torch.ones_like(ids),
                                                    target_sizes=batch["target_sizes"])
    one_d = batch["position_ids"][:1].expand_as(batch["position_ids"])
    swapped = _joined(samples, [2, 1, 0, 3])
    for name, overrides in (("the batch's slice sizes", {"position_ids": batch_grids}),
                            ("1-D positions", {"position_ids": one_d}), ("slices swapped", swapped)):
        assert not all(torch.equal(value, batch[key]) for key, value in overrides.items()), name
        error = families.logit_error(batch, families.packed_logits(setup.packed, batch, **overrides), refs)
        assert refs[3].logits.is_far(error), name

    tokens = batch["input_ids"]
    whole_row = index(tokens, batch["mm_token_type_ids"], torch.ones_like(tokens), target_sizes=batch["target_sizes"])
    for start, length in spans:  # the rotary rows (T, H, W); the text row only marks the sample boundaries
        shift = whole_row[1:, :, start:start + length] - batch["position_ids"][1:, :, start:start + length]
        assert (shift == shift[0, 0, 0]).all()


def test_minicpmv4_7_refusals():
    """A config without the canvas marker ids, another language model, a video and context parallelism are refused
    by name; the family is no longer among the missing rules."""
    from transformers import GPT2Config

    from vlm_pack.models import UnsupportedModelError, get_family
    from vlm_pack.models.missing import MISSING_RULES

    assert "minicpmv4_7" not in MISSING_RULES
    setup = families.setup_for("minicpmv4_7")
    config = setup.packed.config.__class__.from_dict(setup.packed.config.to_dict())
    config.newline_id = None
    with pytest.raises(UnsupportedModelError, match=r"no canvas marker ids \['newline_id'\]"):
        get_family(config)
    config.text_config = GPT2Config()
    with pytest.raises(UnsupportedModelError, match=r"language model 'gpt2' \(proven language models"):
        get_family(config)
    with pytest.raises(UnsupportedModelError, match="context_parallel_size=2 with a minicpmv4_7 model"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, context_parallel_size=2)
