"""Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (the text-generating half of the Omni models), text, image and audio
inputs: time-aligned mRoPE from the model's own ``get_rope_index``, on each sample alone.

Rules (images proven in tests/test_families_round3b.py, audio in tests/test_audio_packing.py): positions are
``[4, 1, T]`` (row 0 a per-sample text arange, rows 1-3 temporal/height/width from the thinker's own
``get_rope_index``, which reads the image / audio / video tokens from the ids, each clip's token count from its
``audio_seqlens``, and counts media across a batch's rows: the collator runs it on each sample alone,
``rope_index_alone``, with the sample's clip lengths); ``pixel_values`` rows are patches split by
``image_grid_thw`` and the vision tower runs per image on its own ``cu_seqlens``.
Audio: ``input_features`` / ``feature_attention_mask`` hold one row per clip (``vision_rows`` ``"audio"``), each
sample's clips in row order; samples with audio are encoded alone (Qwen3-Omni's processor pads a call's clips to
the longest, and Whisper's last frames see that padding). The audio tower cuts each clip into chunks of
``2 * n_window`` frames and attends within windows of a clip, never across clips. Qwen2.5-Omni masks its
convolutions, so a clip's features do not depend on the other clips of the call; Qwen3-Omni's convolutions read the
padding up to the call's longest chunk, so a packed micro-batch is exact only when every sample with audio has the
same longest chunk (``audio_batch``: refused by name otherwise).
Refused: videos (their positions interleave with the audio track's in time, ``use_audio_in_video``: not proven).
The full Omni models (thinker + talker, ``qwen2_5_omni`` / ``qwen3_omni_moe``) are not registered: train the thinker.
"""

from . import FamilySpec, register_family

_PROOF = "tests/test_families_round3b.py"
# One row per audio clip: the Whisper features (padded to 30 s) and their frame mask, in sample order.
_AUDIO_ROWS = {"input_features": "audio", "feature_attention_mask": "audio"}

QWEN2_5_OMNI_THINKER = register_family(FamilySpec(
    name="qwen2_5_omni_thinker", model_types=("qwen2_5_omni_thinker",), proof=_PROOF,
    min_transformers="5.24",  # proven on 5.24 only (registered in round 3, never run on the floor)
    proven={
        "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen2_5_omni_thinker]",
        "audio": "tests/test_audio_packing.py::test_audio_batch_equals_each_sample_alone[qwen2_5_omni_thinker]",
        "context_parallel": "tests/test_families_round3b.py::test_edge_batch_equals_each_sample_alone[qwen2_5_omni_thinker]",
    },
    positions="mrope", rope_index_model="Qwen2_5OmniThinkerForConditionalGeneration", rope_index_alone=True,
    vision_rows=_AUDIO_ROWS,
    media_tokens=("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"),
))
def _qwen3_audio_chunks(config, clips: list[list[int]]) -> str | None:
    """Qwen3-Omni's audio tower cuts each clip into chunks of ``2 * n_window`` mel frames, pads every chunk of the
    call to the call's longest, and its convolutions (unmasked) read that padding; the attention window is the
    longest chunk's length too. A packed row is one call: exact only if every sample with audio has the same
    longest chunk as the batch (its own call alone would pad to it)."""
    chunk = 2 * config.audio_config.n_window
    longest = {index: min(chunk, max(frames)) for index, frames in enumerate(clips) if frames}
    if len(set(longest.values())) <= 1:
        return None
    return (f"samples {sorted(longest)} have longest audio chunks of {[longest[i] for i in sorted(longest)]} mel "
            f"frames; the Qwen3-Omni audio tower pads every {chunk}-frame chunk of a call to the call's longest and "
            "its convolutions read that padding, so a sample whose clips are all shorter than "
            f"{chunk} frames gets other audio features beside a longer clip than alone. Batch such samples with clips "
            f"of the same length, or give every sample a clip of at least {chunk} frames")


QWEN3_OMNI_MOE_THINKER = register_family(FamilySpec(
    name="qwen3_omni_moe_thinker", model_types=("qwen3_omni_moe_thinker",), proof=_PROOF,
    min_transformers="5.24",  # proven on 5.24 only (registered in round 3, never run on the floor)
    proven={
        "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen3_omni_moe_thinker]",
        "audio": "tests/test_audio_packing.py::test_audio_batch_equals_each_sample_alone[qwen3_omni_moe_thinker]",
        "context_parallel": "tests/test_families_round3b.py::test_edge_batch_equals_each_sample_alone[qwen3_omni_moe_thinker]",
    },
    positions="mrope", rope_index_model="Qwen3OmniMoeThinkerForConditionalGeneration", rope_index_alone=True,
    vision_rows=_AUDIO_ROWS, audio_batch=_qwen3_audio_chunks,
    media_tokens=("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"),
))
