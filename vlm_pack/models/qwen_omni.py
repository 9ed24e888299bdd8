"""Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (the text-generating half of the Omni models), text, image and audio
inputs: time-aligned mRoPE from the model's own ``get_rope_index``, on each sample alone.

Rules (images proven in tests/test_family_qwen_omni.py, audio in tests/test_audio_packing.py): positions are
``[4, 1, T]`` (row 0 a per-sample text arange, rows 1-3 temporal/height/width from the thinker's own
``get_rope_index``, which reads the image / audio / video tokens from the ids, each clip's token count from its
``audio_seqlens``, and counts media across a batch's rows: the collator runs it on each sample alone,
``rope_index_alone``, with the sample's clip lengths); ``pixel_values`` rows are patches split by
``image_grid_thw`` and the vision tower runs per image on its own ``cu_seqlens``.
Audio: ``input_features`` / ``feature_attention_mask`` hold one row per clip (``vision_rows`` ``"audio"``), each
sample's clips in row order; samples with audio are encoded alone (Qwen3-Omni's processor pads a call's clips to
the longest, and Whisper's last frames see that padding). The audio tower cuts each clip into chunks of
``2 * n_window`` frames and attends within windows of a clip, never across clips. Qwen2.5-Omni masks its
convolutions, so a clip's features do not depend on the other clips of the call; Qwen3-Omni pads every chunk of a
call to the call's longest and its convolutions read that padding (the attention window scales with it too), so
``enable_packing`` runs its audio tower once per sample of a packed row (``prepare_model``: the clips of each
sample counted from its ``<|audio_bos|>`` markers between ``cu_seq_lens_q`` boundaries), as each sample alone.
Refused: videos (their positions interleave with the audio track's in time, ``use_audio_in_video``: not proven).
The full Omni models (thinker + talker, ``qwen2_5_omni`` / ``qwen3_omni_moe``) are not registered: train the thinker.
"""

import torch

from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Positions, Proof, VisionRows

_PROOF = "tests/test_family_qwen_omni.py"
# One row per audio clip: the Whisper features (padded to 30 s) and their frame mask, in sample order.
_AUDIO_ROWS = {"input_features": "audio", "feature_attention_mask": "audio"}

QWEN2_5_OMNI_THINKER = register_family(FamilySpec(
    name="qwen2_5_omni_thinker", model_types=("qwen2_5_omni_thinker",),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen2_5_omni_thinker]",
            "audio": "tests/test_audio_packing.py::test_audio_batch_equals_each_sample_alone[qwen2_5_omni_thinker]",
            "context_parallel": "tests/test_family_qwen_omni.py::test_edge_batch_equals_each_sample_alone[qwen2_5_omni_thinker]",
        },
    ),
    encoding=EncodingRules(
        positions=Positions("mrope", rope_index_model="Qwen2_5OmniThinkerForConditionalGeneration", alone=True),
        media_tokens=("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"),
        vision=VisionRows(rows=_AUDIO_ROWS),
    ),
))


def _clips_per_sample(module, args, kwargs):
    """Forward pre-hook of ``Qwen3OmniMoeThinkerModel``: on a packed row with audio, how many clips each sample holds
    (its ``<|audio_bos|>`` tokens between ``cu_seq_lens_q`` boundaries), for :func:`_audio_per_sample`."""
    module._vlm_pack_clips = None
    cu_seqlens, features = kwargs.get("cu_seq_lens_q"), kwargs.get("input_features")
    if cu_seqlens is None or features is None:
        return None
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("Qwen3-Omni audio in a packed row needs input_ids (not inputs_embeds): the audio tower runs "
                         "once per sample, whose clips are counted from the ids")
    starts = (input_ids[0] == module.config.audio_start_token_id).long().cumsum(0)
    ends = torch.cat([starts.new_zeros(1), starts])[cu_seqlens.long()]
    clips = ends.diff().tolist()
    if sum(clips) != features.shape[0]:
        raise ValueError(f"Qwen3-Omni packed row: {sum(clips)} <|audio_bos|> markers for {features.shape[0]} audio "
                         "clips (input_features rows); encode the batch with VLMPackingCollator")
    module._vlm_pack_clips = [count for count in clips if count]
    return None


def _audio_per_sample(module):
    """``get_audio_features`` of one ``Qwen3OmniMoeThinkerModel``, run once per sample of a packed row: its audio
    tower pads every chunk of a call to the call's longest and its convolutions read that padding, so a sample's
    features equal those of the sample alone only in a call of its own clips."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    stock = module.get_audio_features

    def get_audio_features(input_features, feature_attention_mask=None, audio_feature_lengths=None, **kwargs):
        clips = getattr(module, "_vlm_pack_clips", None)
        if not clips or len(clips) == 1 or feature_attention_mask is None:
            return stock(input_features, feature_attention_mask, audio_feature_lengths, **kwargs)
        outputs = [stock(features, mask, None, **kwargs) for features, mask in
                   zip(input_features.split(clips), feature_attention_mask.split(clips))]
        hidden = torch.cat([output.last_hidden_state for output in outputs])
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=hidden)

    return get_audio_features


def _prepare_qwen3_omni(model: torch.nn.Module) -> None:
    """Every ``Qwen3OmniMoeThinkerModel`` (once): its audio tower run once per sample of a packed row."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerModel

    for module in model.modules():
        if isinstance(module, Qwen3OmniMoeThinkerModel) and getattr(module, "_vlm_pack_clip_hook", None) is None:
            module._vlm_pack_clip_hook = module.register_forward_pre_hook(_clips_per_sample, with_kwargs=True)
            module.get_audio_features = _audio_per_sample(module)


QWEN3_OMNI_MOE_THINKER = register_family(FamilySpec(
    name="qwen3_omni_moe_thinker", model_types=("qwen3_omni_moe_thinker",),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen3_omni_moe_thinker]",
            "audio": "tests/test_audio_packing.py::test_audio_batch_equals_each_sample_alone[qwen3_omni_moe_thinker]",
            "context_parallel": "tests/test_family_qwen_omni.py::test_edge_batch_equals_each_sample_alone[qwen3_omni_moe_thinker]",
        },
    ),
    model=ModelRules(prepare_model=_prepare_qwen3_omni),
    encoding=EncodingRules(
        positions=Positions("mrope", rope_index_model="Qwen3OmniMoeThinkerForConditionalGeneration", alone=True),
        media_tokens=("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"),
        vision=VisionRows(rows=_AUDIO_ROWS),
    ),
))
