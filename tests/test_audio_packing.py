"""Audio inputs packed per sample (issue 39): the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers.

The collator encodes each sample with audio alone (a clip's Whisper features depend on the processor call's
padding), gives each sample its clips' rows of ``input_features`` / ``feature_attention_mask`` in row order
(``VisionRows.rows`` ``"audio"``), and computes positions per sample with the thinker's own
``get_rope_index`` (``audio_seqlens`` from the frame mask). The audio tower cuts each clip into windows of its own
(``cu_seqlens`` over the clip's chunks), so clips never attend across clips or samples. Proof: a micro-batch mixing
an audio sample holding two clips, an image sample, an audio + image sample and a text-only chat, packed through
``enable_packing`` + ``VLMPackingCollator``, against each sample ALONE through the stock thinker (sdpa, fp32 CPU):
logits, per-sample losses, the model's own loss, gradients (tests/tolerance.py). Each rule has a corruption that
must fail: clips given to the wrong sample, positions over the whole row, the two clips of a sample merged into one.
Qwen3-Omni's tower pads every chunk of a call to the call's longest (its convolutions read that padding):
enable_packing runs it once per sample, and one call over the whole row is caught. Token-budget
plans count each clip's tokens as the processor does. Other families refuse audio by name.
Synthetic waveforms (tones plus noise at 16 kHz), no downloads.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")

OMNI = ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"]
# Seconds of each clip (16 kHz, 100 mel frames a second). Sample 0 holds two clips whose merged token count equals
# the sum of theirs (the merge corruption stays well-formed) and whose longest is shorter than the audio tower's
# chunk (Qwen2.5's tiny tower: 8 frames; Qwen3's: 100 frames, as the checkpoints), unlike sample 2's 1.3-s clip.
CLIPS = {"qwen2_5_omni_thinker": ((0.05, 0.6), 1.3), "qwen3_omni_moe_thinker": ((0.6, 0.16), 1.3)}


def wave(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 900) * t) + 0.05 * rng.standard_normal(t.size)
    return tone.astype(np.float32)


def audio_examples(family: str) -> list[dict]:
    """An audio sample with two clips, an image sample, an audio + image sample and a text-only chat."""
    from vlm_pack.testing.data import photo_examples, sample_photos, text_chat_examples

    (first, second), third = CLIPS[family]
    photo = sample_photos(84)["chelsea"].resize((56, 42))
    audio = [{"type": "audio", "audio": wave(first, 1)}, {"type": "text", "text": "And then:"},
             {"type": "audio", "audio": wave(second, 2)}]
    return [
        {"messages": [{"role": "user", "content": [*audio, {"type": "text", "text": "What do you hear?"}]},
                      {"role": "assistant", "content": "Two tones."}]},
        photo_examples(1, seed=0, max_side=56)[0],
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "audio", "audio": wave(third, 3)},
                                                   {"type": "image", "image": photo},
                                                   {"type": "text", "text": "Both?"}]},
                      {"role": "assistant", "content": "A hum and a cat."}]},
        text_chat_examples(1, seed=0, max_turns=1)[0],
    ]


@pytest.mark.parametrize("family", OMNI)
def test_audio_batch_equals_each_sample_alone(family):
    """Packed with context-parallel alignment slots (each sample padded to a multiple of 4, as cp=2 needs) == each
    sample alone (logits, losses, own loss, gradients); the clips' rows follow their samples, the audio tokens equal
    the processor's count per clip, and only the answers carry labels."""
    setup = families.setup_for(family)
    collator = families.VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                                           context_parallel_size=2)
    setup = dataclasses.replace(setup, collator=collator)
    examples = audio_examples(family)
    batch = setup.collator(examples)
    processor = setup.processor
    frames = batch["feature_attention_mask"].sum(-1).tolist()
    assert frames == [round(s * 100) for s in (*CLIPS[family][0], CLIPS[family][1])]  # three clips, in row order
    tokens = processor._get_num_multimodal_tokens(audio_lengths=[n * 160 for n in frames])["num_audio_tokens"]
    assert int((batch["input_ids"] == processor.audio_token_id).sum()) == sum(tokens)
    meta = families.packing_metadata(batch)
    assert not torch.equal(meta["cu_seqlens"], meta["cu_seqlens_padded"])  # alignment slots present
    answers = processor.tokenizer.decode(batch["labels"][batch["labels"] != -100])
    assert answers.replace("<|im_end|>", "|") == "Two tones.|" + _answers(examples[1]) + "A hum and a cat.|" + \
        _answers(examples[3])
    result = families.compare(setup, examples)
    print(family, "audio", result)
    families.assert_exact(result)


def _answers(example: dict) -> str:
    return "".join((m["content"] if isinstance(m["content"], str) else "".join(
        p["text"] for p in m["content"] if p["type"] == "text")) + "|" for m in example["messages"]
        if m["role"] == "assistant")


def _clip_rows(setup, examples) -> list[dict]:
    samples = setup.collator._encode_all(examples)[0]
    return [{key: sample[key] for key in ("input_features", "feature_attention_mask") if key in sample}
            for sample in samples]


def _fails(setup, batch, refs, **overrides) -> bool:
    """The corrupted batch is refused by the model or its logits are far from each sample alone."""
    try:
        logits = families.packed_logits(setup.packed, batch, **overrides)
    except (RuntimeError, ValueError):
        return True
    return refs[3].logits.is_far(families.logit_error(batch, logits, refs))


@pytest.mark.parametrize("family", OMNI)
@torch.no_grad()
def test_audio_corruptions_are_caught(family):
    """Each audio rule dropped breaks the comparison the clean batch passes: the clips of samples 0 and 2 in swapped
    order (features attributed to the wrong sample); positions over the whole row (attention boundaries kept); the
    two clips of sample 0 merged into one clip (the tower's windows run across them)."""
    setup = families.setup_for(family)
    examples = audio_examples(family)
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    rows = _clip_rows(setup, examples)

    swapped = {key: torch.cat([rows[2][key], rows[0][key]]) for key in rows[0]}
    assert all(swapped[key].shape == batch[key].shape for key in swapped)
    assert _fails(setup, batch, refs, **swapped)

    whole_row = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["position_ids"])
    assert _fails(setup, batch, refs, position_ids=whole_row)  # boundaries kept: the rope angles alone are wrong

    features, mask = batch["input_features"], batch["feature_attention_mask"]
    first, second = mask[0].sum().item(), mask[1].sum().item()
    width = max(features.shape[-1], first + second)
    features, mask = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (features, mask))
    merged_row = torch.zeros_like(features[:1])
    merged_row[0, :, :first + second] = torch.cat([features[0, :, :first], features[1, :, :second]], dim=-1)
    merged_mask = torch.zeros_like(mask[:1])
    merged_mask[0, :first + second] = 1
    merged = {"input_features": torch.cat([merged_row, features[2:]]),
              "feature_attention_mask": torch.cat([merged_mask, mask[2:]])}
    assert (families.packed_logits(setup.packed, batch, input_features=features, feature_attention_mask=mask)
            - families.packed_logits(setup.packed, batch)).abs().max() == 0  # wider padding alone changes nothing
    assert _fails(setup, batch, refs, **merged)


@torch.no_grad()
def test_corruption_qwen3_omni_audio_tower_over_the_whole_row(monkeypatch):
    """Qwen3-Omni's audio tower pads every chunk of a call to the call's longest (its convolutions read that
    padding): enable_packing runs it once per sample of a packed row. One call over the whole row (the stock
    get_audio_features) gives sample 0, whose clips are all under one 100-frame chunk, other features and is caught;
    the row's clip count must match its <|audio_bos|> markers."""
    setup = families.setup_for("qwen3_omni_moe_thinker")
    examples = audio_examples("qwen3_omni_moe_thinker")
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    inner = setup.packed.model
    assert inner._vlm_pack_clips == [2, 1]  # clips of the samples holding audio, in row order
    extra = {key: torch.cat([batch[key], batch[key][:1]]) for key in ("input_features", "feature_attention_mask")}
    with pytest.raises(ValueError, match=re.escape("3 <|audio_bos|> markers for 4 audio clips")):
        families.packed_logits(setup.packed, batch, **extra)
    monkeypatch.delattr(inner, "get_audio_features")  # the class's: one tower call for every clip of the row
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
    print("qwen3_omni one audio-tower call", error)
    assert refs[3].logits.is_far(error)


def test_budget_plans_count_audio_tokens_as_the_processor():
    """Token-budget planning counts each clip's tokens from its length (the processor's own rule, the length taken
    in whole feature hops): planned == materialised, for clip lengths that are not whole hops too."""
    from vlm_pack.budget import measure_lengths

    for family in OMNI:
        collator = families.setup_for(family).collator
        examples = audio_examples(family)
        odd = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": wave(1.2345, 4)}]},
                            {"role": "assistant", "content": "Noise."}]}
        examples = [*examples, odd]
        planned = measure_lengths(examples, collator, progress=False)
        assert planned.tokens.tolist() == [collator([example])["input_ids"].shape[1] for example in examples]
        assert planned.images.tolist() == [2, 3, 2, 0, 1]  # media parts: clips + images


@pytest.mark.parametrize("family", ["gemma3n", "phi4_multimodal"])
def test_audio_refused_by_name_for_families_not_proven(family):
    """Families whose audio path is not proven refuse an audio part when the batch is built, naming the family."""
    from vlm_pack.models import UnsupportedModelError

    if family == "gemma3n":
        pytest.importorskip("timm")  # its vision tower
    from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

    processor = tiny_vlm_processor(family)
    collator = families.VLMPackingCollator(processor, max_length=2048, model_config=tiny_vlm(family, processor).config)
    example = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": wave(0.5, 0)}]},
                            {"role": "assistant", "content": "A beep."}]}
    with pytest.raises(UnsupportedModelError, match=f"an audio clip with a {family} model: audio inputs"):
        collator([example])


def test_bad_audio_is_refused_with_the_fix():
    """A file path, a stereo array and a clip over the feature extractor's 30 s are refused, naming the sample."""
    collator = families.setup_for("qwen2_5_omni_thinker").collator
    for payload, reason in (("clip.wav", "pass its decoded waveform"), (np.zeros((2, 800)), "1-D float array"),
                            (np.zeros(480001, np.float32), "longer than the 480000")):
        example = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": payload}]},
                                {"role": "assistant", "content": "A beep."}]}
        with pytest.raises(ValueError, match=f"sample 0, turn 0: .*{reason}"):
            collator([example])


def test_audio_part_without_an_audio_processor_is_refused():
    """A processor without an audio feature extractor (GLM-4V's) refuses an audio part as unsupported, naming
    where audio is packed; a payload-less audio part is refused naming the field."""
    collator = families.setup_for("glm4v").collator
    example = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": wave(0.5, 0)}]},
                            {"role": "assistant", "content": "A beep."}]}
    with pytest.raises(ValueError, match="sample 0, turn 0: unsupported content part of type 'audio' here: audio is "
                                         "packed only by"):
        collator([example])
    omni = families.setup_for("qwen2_5_omni_thinker").collator
    example["messages"][0]["content"] = [{"type": "audio"}]
    with pytest.raises(ValueError, match="sample 0, turn 0: an audio part needs its waveform under 'audio'"):
        omni([example])


def test_audio_placeholder_typed_in_text_is_refused():
    """The processor's audio placeholder typed inside text would add an audio slot without a clip: refused."""
    collator = families.setup_for("qwen2_5_omni_thinker").collator
    example = {"messages": [{"role": "user", "content": "Hear <|AUDIO|> this"},
                            {"role": "assistant", "content": "No."}]}
    with pytest.raises(ValueError, match=r"sample 0, turn 0: text contains the reserved placeholder '<\|AUDIO\|>'"):
        collator([example])
