"""Qwen2-Audio (Whisper-style audio tower + Qwen2 text) exact under packing (issue 47).

An audio LLM, so its edge batch is made of audio: a system prompt with a one-word answer about a clip, two clips of
different lengths in one turn, a text-only chat with a system prompt, and a clip inside a second user turn; packed
(with context-parallel alignment slots) through ``enable_packing`` + ``VLMPackingCollator`` against each sample run
ALONE through the stock transformers model (``attn_implementation="sdpa"``, fp32 CPU): logits, per-sample losses,
the model's own loss, gradients (tests/tolerance.py). Labels come from the official template
(``Qwen2AudioProcessor.default_chat_template``). Each rule has a corruption that must fail. Token-budget planning is
refused by reason (the processor cannot count a clip's tokens from its length).

Tiny model and offline processor: ``vlm_pack/testing/families/qwen2_audio.py`` (via ``vlm_pack.testing.tiny_families``).
Synthetic waveforms (tones plus noise at 16 kHz, tests/test_audio_packing.py), no downloads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import test_vlm_families as families
from test_audio_packing import wave

pytestmark = pytest.mark.usefixtures("one_thread")

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


@pytest.mark.parametrize("family", AUDIO)
def test_unproven_language_model_is_refused(family):
    """Any language model but Qwen2, or Qwen2 with an unhandled feature (sliding layers), is refused by name."""
    families.test_unproven_language_model_is_refused(family)
