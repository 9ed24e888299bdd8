"""Round-3b VLM families exact under packing (issue 39): PaddleOCR-VL, ...

Each family gets the proof of the families before it (tests/test_vlm_families.py, whose harness runs here): the edge
micro-batch (system prompts, a one-word answer, an image inside an assistant turn, text-only, images of different
sizes, a multi-image sample) packed through ``enable_packing`` + ``VLMPackingCollator``, with context-parallel
alignment slots where the family allows them, against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py). Each rule
has a corruption that must break the comparison (vision rows given to the wrong sample, positions not restarted, and
the family's own position rule dropped). Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``, these included).

Substituted (no hub here): see ``vlm_pack/testing/tiny_families_round3b.py`` per family.
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")

ROUND3B = ["paddleocr_vl", "ernie4_5_vl_moe", "hunyuan_vl", "ovis2", "qwen2_5_omni_thinker",
           "qwen3_omni_moe_thinker", "lfm2_vl", "aria", "qianfan_ocr"]
MROPE = ["paddleocr_vl", "ernie4_5_vl_moe", "hunyuan_vl", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"]


@pytest.mark.parametrize("family", ROUND3B)
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", [f for f in ROUND3B if f != "hunyuan_vl"])  # HunYuan: its own test below
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", MROPE)
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", [f for f in ROUND3B if f != "ovis2"])  # Ovis 2: its own test below
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


def test_ovis2_image_tokens_are_its_atoms():
    """Ovis 2's processor replaces its <image> placeholder whole (<IMG_START>, <IMG_ATOM> runs, grid markers,
    <IMG_END>): the family's image_token (<IMG_ATOM>) is what the collator counts, for the statistics and for
    splitting the tile rows of pixel_values per sample (4 atoms per tile here)."""
    from vlm_pack.testing.data import photo_examples

    setup = families.setup_for("ovis2")
    examples = photo_examples(3, seed=2, max_side=84)
    batch = setup.collator(examples)
    atom = setup.processor.tokenizer.convert_tokens_to_ids("<IMG_ATOM>")
    assert not (batch["input_ids"] == setup.processor.image_token_id).any()
    assert batch["vlm_pack"]["stats"].image_tokens == int((batch["input_ids"] == atom).sum()) > 0
    assert batch["pixel_values"].shape[0] * 4 == int((batch["input_ids"] == atom).sum())


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
    collator.family = dataclasses.replace(collator.family, encode_alone=False)
    with pytest.raises(ValueError, match="inhomogeneous"):
        collator(examples)


@torch.no_grad()
def test_corruption_hunyuan_image_ordinal_restarts_per_sample():
    """HunYuan-VL's last rope axis is the image ordinal, which its get_rope_index counts across the rows of a batch:
    positions from one rope-index call on the whole padded micro-batch (the family's rope_index_alone off: how the
    stock model positions a padded batch) give later samples' images ordinals their samples alone never see, and
    are caught; so are vision rows given to the wrong sample. (Its forward takes no text row, so the harness's
    position-id boundary check does not apply: boundaries come from cu_seq_lens_* alone.)"""
    import dataclasses

    setup = families.setup_for("hunyuan_vl")
    examples = families.swap_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["position_ids"].shape[0] == 4  # the rope axes only
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    assert refs[3].logits.is_far(families.logit_error(
        batch, families.packed_logits(setup.packed, families.swapped_vision(setup, batch, examples)), refs))

    joint = families.VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config)
    joint.family = dataclasses.replace(joint.family, rope_index_alone=False)  # one call on the padded batch
    counted = joint(examples)["position_ids"]
    assert not torch.equal(counted, batch["position_ids"])
    assert refs[3].logits.is_far(families.logit_error(
        batch, families.packed_logits(setup.packed, batch, position_ids=counted), refs))


def test_hunyuan_length_dependent_rope_is_refused():
    """HunYuan's checkpoints label their fixed-alpha NTK rope "dynamic" (static angles: accepted, proven above); a
    "dynamic" rope without alpha rescales with the sequence length, which packing changes: refused by name."""
    from vlm_pack.models import UnsupportedModelError, get_family

    config = families.setup_for("hunyuan_vl").packed.config
    config = config.__class__.from_dict(config.to_dict())
    assert get_family(config).name == "hunyuan_vl"
    del config.text_config.rope_parameters["alpha"]
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' without 'alpha'"):
        get_family(config)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_omni_video_is_refused(family):
    """The Omni thinkers' videos' positions interleave with the audio track in time: a video is refused when the
    batch is built, naming what to do (audio parts are packed: tests/test_audio_packing.py)."""
    import numpy as np

    collator = families.setup_for(family).collator
    chat = [{"role": "assistant", "content": "A beep."}]
    video = {"messages": [{"role": "user", "content": [{"type": "video", "video": np.zeros((2, 28, 28, 3), np.uint8)}]},
                          *chat]}
    with pytest.raises(ValueError, match=f"a video with a {family} model: video inputs .* is not proven for this family"):
        collator([video])


@torch.no_grad()
def test_corruption_lfm2_conv_window_carried_across_samples(monkeypatch):
    """LFM2's short-convolution layers must restart their window per sample: enable_packing installs the
    boundary-aware forward on its Lfm2ShortConv modules, and the window carried over the whole row (boundaries
    ignored) is caught. The edge batch holds tiled images (crops + thumbnail) too: their rows follow their sample."""
    from vlm_pack.attention import linear as la

    setup = families.setup_for("lfm2_vl")
    convs = [m for m in setup.packed.modules() if type(m).__name__ == "Lfm2ShortConv"]
    assert convs and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in convs)
    examples = families.edge_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["pixel_values"].shape[0] > 5  # more tiles than the edge batch's 5 images
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))
    exact, total = la.segmented_causal_conv1d, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(reference_fn, hidden_states, weight, bias, activation, layout):
        return exact(reference_fn, hidden_states, weight, bias, activation, whole_row)

    monkeypatch.setattr(la, "segmented_causal_conv1d", carried)
    assert refs[3].logits.is_far(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))


@pytest.mark.parametrize(("model_type", "rule"), [
    ("deepseek_ocr2", "local crops"),
])
def test_round3b_families_not_proven_are_refused_by_name(model_type, rule):
    """The families of this round whose packing needs a rule vlm_pack lacks: refused, naming the rule."""
    from types import SimpleNamespace

    from vlm_pack.models import UnsupportedModelError, get_family

    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}': .*{rule}"):
        get_family(SimpleNamespace(model_type=model_type))


def test_lfm2_text_model_packed_equals_each_sample_alone():
    """LFM2 on its own (Lfm2ForCausalLM, the language model of LFM2-VL): short-convolution (window 3) and attention
    layers, text chats packed with the tokenizer's collator against each sample alone through the stock model
    (logits, losses, the model's own loss, gradients)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.integrations.hf_model import enable_packing
    from vlm_pack.testing.data import text_chat_examples
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()

    def model():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = Lfm2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                                conv_L_cache=3, block_auto_adjust_ff_dim=False, initializer_range=0.2)
            return Lfm2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()

    packed = enable_packing(model())
    collator = VLMPackingCollator(tokenizer, max_length=1024, model_config=packed.config)
    assert collator.family.name == "lfm2_vl"
    setup = families.Setup("lfm2", tokenizer, model(), packed, collator)
    result = families.compare(setup, text_chat_examples(3, seed=1, max_turns=2))
    print("lfm2", result)
    families.assert_exact(result)


def test_aria_image_splitting_is_refused():
    """Aria with split_image=True: its processor gives every image of a call the call's largest crop count while
    pixel_values hold each image's own crops; the family declares one pixel row per image, so the collator refuses
    the batch by name instead of guessing which crops belong to which sample."""
    from PIL import Image

    setup = families.setup_for("aria")
    processor = families.tiny_vlm_processor("aria")
    processor.images_kwargs = {**processor.images_kwargs, "split_image": True}  # the processor call default
    collator = families.VLMPackingCollator(processor, max_length=4096, model_config=setup.packed.config)
    wide = {"messages": [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (980, 490))},
                                                       {"type": "text", "text": "Wide?"}]},
                         {"role": "assistant", "content": "Yes."}]}
    with pytest.raises(ValueError, match="processor output 'pixel_values' has shape .* one row per image"):
        collator([wide, families.swap_examples()[0]])


@pytest.mark.parametrize("family", ["ovis2", "qianfan_ocr"])
def test_unproven_language_model_is_refused(family):
    """Composite families whose language model is a separate registered text family: any other language model, or
    a proven one with an unhandled feature, is refused by name (the harness's check)."""
    families.test_unproven_language_model_is_refused(family)
