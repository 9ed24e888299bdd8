"""Tiny Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (images, audio; no video):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, mrope_text
from ..tiny_models import qwen_vision_patching

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Qwen2.5-Omni thinker (images, audio; no video)

# Qwen2.5-VL's tiny vision tower and image processor (56-112 px images, 14-px patches merged 2x2); a real Whisper
# feature extractor (16 mel bins, 100 frames a second, clips padded to 30 s as the Omni processor asks) and a
# one-layer audio tower attending in windows of 8 mel frames (n_window=4: several windows per clip).
_OMNI_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


# ChatML with Omni's image markup, plus each audio part as the official Omni template writes it.
_OMNI_TEMPLATE = chatml_template("<|vision_bos|><|IMAGE|><|vision_eos|>").replace(
    "{%- elif part['type'] == 'video' -%}",
    "{%- elif part['type'] == 'audio' -%}<|audio_bos|><|AUDIO|><|audio_eos|>{%- elif part['type'] == 'video' -%}")


def _qwen2_5_omni_thinker_processor() -> ProcessorMixin:
    from transformers import Qwen2_5OmniProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor

    patching = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, **patching),
        video_processor=Qwen2VLVideoProcessor(**patching),
        feature_extractor=WhisperFeatureExtractor(feature_size=16),
        tokenizer=family_tokenizer(_OMNI_TOKENS),
        chat_template=_OMNI_TEMPLATE,
    )


def _qwen2_5_omni_thinker_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    ids = processor.tokenizer.convert_tokens_to_ids
    config = Qwen2_5OmniThinkerConfig(
        text_config=mrope_text(processor, initializer_range, layers, [2, 3, 3]),
        # Block 0 windowed (56-px windows: several per image), block 1 full attention, as the tiny Qwen2.5-VL.
        vision_config=qwen_vision_patching({"depth": 2, "hidden_size": 32, "out_hidden_size": HIDDEN, "intermediate_size": 64,
                                      "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [1]},
                                     initializer_range),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "output_dim": HIDDEN, "n_window": 4, "initializer_range": initializer_range},
        audio_token_index=ids("<|AUDIO|>"), image_token_index=ids("<|IMAGE|>"), video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"),
        vision_start_token_id=ids("<|vision_bos|>"), initializer_range=initializer_range,
    )
    return _omni_reference(Qwen2_5OmniThinkerForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float32))


def _all_ones_mask(module, args, kwargs):
    if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None \
            and kwargs.get("input_ids") is not None:
        return args, {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    return None


def _omni_reference(model: PreTrainedModel) -> PreTrainedModel:
    """The Omni thinkers compute their mRoPE positions only when the forward gets an attention_mask (without one
    they fall back to 1-D positions, transformers 5.24). A user's unpacked call passes the processor's mask, so the
    tiny model called without mask or positions (the test suites' reference: each sample alone) gets its all-ones
    mask; packed calls carry their positions and are left alone."""
    model.register_forward_pre_hook(_all_ones_mask, with_kwargs=True)
    return model


# ---------------------------------------------------------------- Qwen3-Omni-MoE thinker (images, audio; no video)

# Qwen3-VL's tiny vision tower (14-px patches merged 2x2, learned position grid, one deepstack layer) and the
# Qwen2.5-Omni thinker's processor (Qwen3OmniMoeProcessor: the same tokens); MoE text: 4 experts, 2 per token.
# Audio tower: the checkpoint's chunking (n_window=50: 1-s chunks of 100 mel frames, which its token-count formula
# assumes) with an attention window of one chunk (n_window_infer=100: several windows per clip over 1 s) and a
# narrow 8-channel convolution stack.


def _qwen3_omni_moe_thinker_processor() -> ProcessorMixin:
    from transformers import Qwen3OmniMoeProcessor

    parts = _qwen2_5_omni_thinker_processor()
    return Qwen3OmniMoeProcessor(image_processor=parts.image_processor, video_processor=parts.video_processor,
                                 feature_extractor=parts.feature_extractor, tokenizer=parts.tokenizer,
                                 chat_template=parts.chat_template)


def _qwen3_omni_moe_thinker_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    ids = processor.tokenizer.convert_tokens_to_ids
    text = mrope_text(processor, initializer_range, layers, [2, 3, 3])
    text["rope_parameters"]["mrope_interleaved"] = True
    config = Qwen3OmniMoeThinkerConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        vision_config=qwen_vision_patching({"depth": 1, "hidden_size": 32, "out_hidden_size": HIDDEN, "intermediate_size": 64,
                                      "num_heads": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
                                     initializer_range),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "output_dim": HIDDEN, "n_window": 50, "n_window_infer": 100,
                      "downsample_hidden_size": 8, "initializer_range": initializer_range},
        audio_token_id=ids("<|AUDIO|>"), image_token_id=ids("<|IMAGE|>"), video_token_id=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), vision_start_token_id=ids("<|vision_bos|>"),
        initializer_range=initializer_range,
    )
    return _omni_reference(Qwen3OmniMoeThinkerForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float32))


BUILDERS = {
    "qwen2_5_omni_thinker": Builder(
        _qwen2_5_omni_thinker_processor,
        _qwen2_5_omni_thinker_model,
        "Qwen tokenizer + Omni's image/audio/video and boundary tokens and ChatML instead of the checkpoint's (no "
        "package ships its template; audio parts as the official template writes them); real Qwen2VLImageProcessor "
        "(56-112 px images), WhisperFeatureExtractor (16 mel bins) and Qwen2_5OmniProcessor",
    ),
    "qwen3_omni_moe_thinker": Builder(
        _qwen3_omni_moe_thinker_processor,
        _qwen3_omni_moe_thinker_model,
        "as qwen2_5_omni_thinker, with Qwen3OmniMoeProcessor and a Qwen3-VL-style vision tower",
    ),
}
