"""Round-4 families exact under packing (issue 47).

Each family gets the proof of the families before it (tests/test_vlm_families.py, whose harness runs here): the edge
micro-batch (system prompts, a one-word answer, an image inside an assistant turn, text-only, images of different
sizes, a multi-image sample; audio where the family takes it) packed through ``enable_packing`` +
``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py). Each rule
has a corruption that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``, these included).

Substituted (no hub here): see ``vlm_pack/testing/tiny_families_round4.py`` per family.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import test_vlm_families as families
from test_audio_packing import wave

pytestmark = pytest.mark.usefixtures("one_thread")

ROUND4 = ["gemma4_unified", "kimi_k25", "lfm3_vl", "mistral4", "video_llama_3"]


@pytest.mark.parametrize("family", ROUND4)
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ROUND4)
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@pytest.mark.parametrize("family", ROUND4)
def test_corruptions_are_caught(family):
    """Vision rows swapped between two samples with same-size images, and positions not restarted per sample (stock
    sdpa reading boundaries from position ids), each break the comparison the clean batch passes."""
    families.test_corruptions_are_caught(family)


# ------------------------------------------------------------------ audio LLMs

AUDIO = ["qwen2_audio"]


def audio_edge_examples() -> list[dict]:
    """The edge batch of an audio LLM: a system prompt with a one-word answer about a clip, two clips of different
    lengths in one turn, a text-only chat with a system prompt, and a clip inside a second user turn (as long as the
    first sample's, another tone: swapping the two is well-formed)."""
    from vlm_pack.testing.data import text_chat_examples

    system = {"role": "system", "content": "You are a terse assistant."}

    def clip(seconds: float, seed: int) -> dict:
        return {"type": "audio", "audio": wave(seconds, seed)}

    return [
        {"messages": [system, {"role": "user", "content": [clip(0.4, 1), {"type": "text", "text": "Speech?"}]},
                      {"role": "assistant", "content": "No"}]},
        {"messages": [{"role": "user", "content": [clip(0.9, 2), {"type": "text", "text": "And:"}, clip(0.25, 3),
                                                   {"type": "text", "text": "Compare them."}]},
                      {"role": "assistant", "content": "The first is longer."}]},
        {"messages": [system, *text_chat_examples(1, seed=3, max_turns=2)[0]["messages"]]},
        {"messages": [{"role": "user", "content": "Listen next."}, {"role": "assistant", "content": "Ready."},
                      {"role": "user", "content": [clip(0.4, 4), {"type": "text", "text": "Pitch?"}]},
                      {"role": "assistant", "content": "High."}]},
    ]


def _audio_setup(family: str) -> families.Setup:
    """The family's setup, its collator padding each sample to a multiple of 4 (context-parallel alignment)."""
    setup = families.setup_for(family)
    collator = families.VLMPackingCollator(setup.processor, max_length=4096, model_config=setup.packed.config,
                                           context_parallel_size=2)
    return dataclasses.replace(setup, collator=collator)


@pytest.mark.parametrize("family", AUDIO)
def test_audio_edge_batch_equals_each_sample_alone(family):
    """The audio edge batch with context-parallel alignment slots == each sample alone: logits, per-sample losses, the
    model's own loss, gradients; the clips' rows follow their samples in order and only the answers carry labels."""
    setup = _audio_setup(family)
    examples = audio_edge_examples()
    batch = setup.collator(examples)
    frames = batch["feature_attention_mask"].sum(-1).tolist()
    assert frames == [round(s * 100) for s in (0.4, 0.9, 0.25, 0.4)]  # four clips, in row order
    meta = families.packing_metadata(batch)
    assert not torch.equal(meta["cu_seqlens"], meta["cu_seqlens_padded"])  # alignment slots present
    answers = setup.processor.tokenizer.decode(batch["labels"][batch["labels"] != -100])
    assert [a.strip() for a in answers.split("<|im_end|>")][:3] == ["No", "The first is longer.", examples[2][
        "messages"][2]["content"].strip()]
    result = families.assert_packed_exact(setup, examples, "audio edge")
    families.MEASURED.setdefault(family, {}).update({f"audio_{k}": v for k, v in result.items()})


@pytest.mark.parametrize("family", AUDIO)
@torch.no_grad()
def test_audio_corruptions_are_caught(family):
    """Each rule dropped breaks the comparison the clean batch passes: the clips of samples 0 and 3 (same length,
    different tones) given to each other's sample; positions not restarted per sample (stock sdpa
    reading boundaries from position ids)."""
    setup = _audio_setup(family)
    examples = audio_edge_examples()
    batch, refs = families.exact_batch(setup, examples)
    rows = [0, 1, 2, 3]
    rows[0], rows[3] = 3, 0
    swapped = {key: batch[key][rows] for key in ("input_features", "feature_attention_mask")}
    assert refs[3].logits.is_far(families.logit_error(batch, families.packed_logits(setup.packed, batch, **swapped),
                                                      refs))
    no_kwargs = dict.fromkeys(families.BOUNDARY_KWARGS)
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.stock, batch, **no_kwargs), refs))
    whole_row = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["position_ids"])
    not_restarted = families.packed_logits(setup.stock, batch, **no_kwargs, position_ids=whole_row)
    assert refs[3].logits.is_far(families.logit_error(batch, not_restarted, refs))



def test_qwen2_audio_budget_planning_is_refused_by_reason():
    """Qwen2AudioProcessor cannot count a clip's tokens from its length (no _get_num_multimodal_tokens): token-budget
    planning is refused with the reason, not planned by guess."""
    from vlm_pack.budget import measure_lengths
    from vlm_pack.models import UnsupportedModelError

    collator = families.setup_for("qwen2_audio").collator
    assert not hasattr(collator.processor, "_get_num_multimodal_tokens")
    with pytest.raises(UnsupportedModelError, match="no _get_num_multimodal_tokens"):
        measure_lengths(audio_edge_examples(), collator, progress=False)


# ------------------------------------------------------------------ Gemma 4 unified: image blocks on every layer


@torch.no_grad()
def test_gemma4_unified_each_rule_is_needed(monkeypatch):
    """Each Gemma 4 unified rule dropped breaks the comparison the clean edge batch passes: image blocks made causal;
    blocks on the sliding layers only (Gemma 4's own rule); the sliding window dropped; the swapped images of two
    samples (same size)."""
    from vlm_pack.integrations import hf_model

    setup = families.setup_for("gemma4_unified")
    examples = families.edge_examples()
    batch, refs = families.exact_batch(setup, examples)
    lengths = families.packing_metadata(batch)["seq_lengths"].tolist()
    assert max(lengths) > setup.packed.config.text_config.sliding_window  # the window bites
    plain = hf_model.varlen_attention
    corruptions = {
        "blocks made causal": lambda *a, **k: plain(*a, **{**k, "block_ids": None}),
        "blocks on sliding layers only": lambda *a, **k: plain(*a, **({**k, "block_ids": None} if k["window"] is None
                                                                      else k)),
        "window dropped": lambda *a, **k: plain(*a, **{**k, "window": None}),
    }
    for name, corrupt in corruptions.items():
        monkeypatch.setattr(hf_model, "varlen_attention", corrupt)
        error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
        print("gemma4_unified", name, error)
        assert refs[3].logits.is_far(error), name
    monkeypatch.undo()
    swap = families.swap_examples()
    swap_batch, swap_refs = families.exact_batch(setup, swap)
    swapped = families.swapped_vision(setup, swap_batch, swap)
    assert swap_refs[3].logits.is_far(families.logit_error(swap_batch, families.packed_logits(setup.packed, swapped),
                                                           swap_refs))


@torch.no_grad()
def test_gemma4_unified_image_longer_than_the_window_is_refused(monkeypatch):
    """The stock sliding layers let an image block see itself past the window, the packed attention does not: an image
    longer than the window is refused by name, not approximated."""
    setup = families.setup_for("gemma4_unified")
    batch = setup.collator(families.edge_examples())
    monkeypatch.setattr(setup.packed.config.text_config, "sliding_window", 40)
    with pytest.raises(ValueError, match=r"an image of 65 tokens > sliding_window=40"):
        families.packed_logits(setup.packed, batch)


# ------------------------------------------------------------------ Mistral 4 inside Mistral3


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


# ------------------------------------------------------------------ LFM3-VL: conv window, sliding window


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
    assert max(families.packing_metadata(batch)["seq_lengths"].tolist()) > setup.packed.config.text_config.sliding_window
    plain = hf_model.varlen_attention
    monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("lfm3_vl window dropped", error)
    assert refs[3].logits.is_far(error)
    monkeypatch.undo()
    exact, total = la.segmented_causal_conv1d, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(reference_fn, hidden_states, weight, bias, activation, layout):
        return exact(reference_fn, hidden_states, weight, bias, activation, whole_row)

    monkeypatch.setattr(la, "segmented_causal_conv1d", carried)
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("lfm3_vl conv window carried", error)
    assert refs[3].logits.is_far(error)
