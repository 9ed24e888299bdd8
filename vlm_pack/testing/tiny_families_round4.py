"""Tiny random models and offline processors for the round-4 families (issue 47).

Built like ``vlm_pack.testing.tiny_families`` (whose builder registry includes these): the small Qwen tokenizer plus
the family's media tokens, the family's own image / audio processor classes built from parameters (tiny images, short
clips), ChatML where no PyPI package ships the official chat template (said per family), and a tiny model built from
a config object (hidden 64, 1-2 layers, a small vision / audio tower).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _Builder, _mistral3_processor, _qwen2_text, _tokenizer, chatml_template
from .tiny_models import TINY_VISION_TOWER, qwen_tokenizer

__all__ = ["ROUND4_AUDIO_BUILDERS", "ROUND4_BUILDERS"]


# ---------------------------------------------------------------- VideoLLaMA 3 (NaViT SigLIP tower + Qwen2 text)

# 14-px patches, 2x2 merge for images; min 56x56 px: our 28-84 px photos give 4-36 image tokens.
_VL3_PATCH = 14


def _video_llama_3_processor() -> ProcessorMixin:
    from transformers import VideoLlama3Processor
    from transformers.models.video_llama_3 import VideoLlama3ImageProcessor, VideoLlama3VideoProcessor

    tokenizer = qwen_tokenizer()
    return VideoLlama3Processor(
        image_processor=VideoLlama3ImageProcessor(patch_size=_VL3_PATCH, merge_size=2, min_pixels=56 * 56,
                                                  max_pixels=112 * 112),
        video_processor=VideoLlama3VideoProcessor(patch_size=_VL3_PATCH, merge_size=2), tokenizer=tokenizer,
        chat_template=chatml_template("<|image_pad|>"),
    )


def _video_llama_3_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import VideoLlama3Config, VideoLlama3ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = VideoLlama3Config(
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "patch_size": _VL3_PATCH, "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
    )
    return VideoLlama3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qwen2-Audio (Whisper-style audio tower + Qwen2 text)

_QWEN2_AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]


def _qwen2_audio_processor() -> ProcessorMixin:
    """The official template: ``Qwen2AudioProcessor.default_chat_template``, shipped in transformers (no generation
    blocks: the collator locates the assistant turns by rendering prefixes)."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    return Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=16),
                               tokenizer=_tokenizer(_QWEN2_AUDIO_TOKENS))


def _qwen2_audio_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(
        text_config=_qwen2_text(len(processor.tokenizer), initializer_range, layers),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "initializer_range": initializer_range},
        audio_token_index=processor.audio_token_id,
    )
    return Qwen2AudioForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Gemma 4 unified (encoder-free: patches embedded per patch)

# Gemma 4's markup tokens as the checkpoints spell them (the official template writes <|image|> / <|audio|>).
_GEMMA4_UNIFIED_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                          "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def _gemma4_unified_processor() -> ProcessorMixin:
    """4-px teacher patches merged 2x2 (8-px model patches), at most 70 soft tokens an image (the smallest budget the
    processor accepts); the official Gemma 4 template (TRL's ``gemma4_v5``, the checkpoints' current revision)."""
    from transformers import Gemma4UnifiedProcessor
    from transformers.models.gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor, Gemma4UnifiedImageProcessor, Gemma4UnifiedVideoProcessor,
    )

    from .tiny_models import official_template

    patching = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}
    return Gemma4UnifiedProcessor(
        feature_extractor=Gemma4UnifiedAudioFeatureExtractor(), image_processor=Gemma4UnifiedImageProcessor(**patching),
        video_processor=Gemma4UnifiedVideoProcessor(**patching), tokenizer=_tokenizer(_GEMMA4_UNIFIED_TOKENS),
        chat_template=official_template("gemma4_v5"),
    )


def _gemma4_unified_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Gemma 4's tiny text (key-equals-value full layers, final softcapping; no per-layer inputs nor MoE, which the
    unified model drops) with a sliding window of 72 tokens (at least an image's 70, as the family needs, and shorter
    than the edge batch's samples) and the encoder-free embedder."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    from .tiny_models import tiny_config

    text = tiny_config("gemma4", initializer_range=initializer_range, layers=max(layers, 2)).text_config.to_dict()
    dropped = ("model_type", "architectures", "vocab_size_per_layer_input", "hidden_size_per_layer_input",
               "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")
    text = {key: value for key, value in text.items() if key not in dropped}
    tokenizer = processor.tokenizer
    config = Gemma4UnifiedConfig(
        text_config={**text, "vocab_size": len(tokenizer), "sliding_window": 72},
        vision_config={"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 32, "mm_posemb_size": 64,
                       "output_proj_dims": 32, "initializer_range": initializer_range},
        audio_config=None, image_token_id=processor.image_token_id, boi_token_id=tokenizer.convert_tokens_to_ids(
            processor.boi_token), eoi_token_id=tokenizer.convert_tokens_to_ids(processor.eoi_token),
        video_token_id=processor.video_token_id, initializer_range=initializer_range,
    )
    return Gemma4UnifiedForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Mistral 4 (Mistral3 VLM, Mistral 4 MLA + MoE text)


def mistral4_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2) -> dict:
    """A tiny Mistral 4 language model: multi-head latent attention (low-rank q / kv, a decoupled 8-dim rope part,
    interleaved), YaRN RoPE with Llama-4 attention scaling by position (both left at the config's defaults, with
    an original context of 16 tokens so both bite inside our samples), a dense first layer then 4 routed experts (2
    per token) + a shared one."""
    from transformers import Mistral4Config

    config = Mistral4Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64,
        initializer_range=initializer_range, attention_dropout=0.0,
    )
    config.rope_parameters = {**config.rope_parameters, "original_max_position_embeddings": 16, "factor": 4.0}
    return config.to_dict()


def _mistral4_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from .tiny_families import _PIXTRAL_MERGE, _PIXTRAL_PATCH

    tokenizer = processor.tokenizer
    config = Mistral3Config(
        vision_config={"model_type": "pixtral", **TINY_VISION_TOWER, "head_dim": 16, "image_size": 56,
                       "patch_size": _PIXTRAL_PATCH, "initializer_range": initializer_range},
        text_config=mistral4_text_config(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=_PIXTRAL_MERGE,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Kimi K2.5 (MoonViT-style tower + DeepSeek-V3 text)

_KIMI_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}


def _kimi_k25_processor() -> ProcessorMixin:
    """14-px patches merged 2x2, at most 64 patches (16 tokens) an image."""
    from transformers import Kimi_K25Processor
    from transformers.models.kimi_k25 import Kimi_K25ImageProcessor, Kimi_K25VideoProcessor

    return Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(patch_size=14, merge_size=2, max_patches=64),
        video_processor=Kimi_K25VideoProcessor(patch_size=14, merge_size=2), tokenizer=_tokenizer(_KIMI_TOKENS),
        chat_template=chatml_template(_KIMI_TOKENS["image_token"]),
    )


def deepseek_v3_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2) -> dict:
    """A tiny DeepSeek-V3 language model: multi-head latent attention, YaRN RoPE (original context 16 tokens, so it
    bites inside our samples), a dense first layer then 4 routed experts (2 per token, one group) + a shared one."""
    return {
        "model_type": "deepseek_v3", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "max_position_embeddings": 64, "initializer_range": initializer_range,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "beta_fast": 32.0, "beta_slow": 1.0},
    }


def _kimi_k25_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Kimi_K25Config(
        text_config=deepseek_v3_text_config(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "patch_size": 14, "pos_emb_height": 16, "pos_emb_width": 16,
                       "initializer_range": initializer_range},
        projection_hidden_size=32, image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        tie_word_embeddings=False,
    )
    return Kimi_K25ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- LFM3-VL (conv + attention NaViT tower, LFM3 hybrid text)


def _lfm3_vl_processor() -> ProcessorMixin:
    """Qwen2-VL's image processor (the one transformers maps lfm3_vl to): 14-px patches merged 2x2, 56-112 px;
    ChatML with Qwen's vision markers (no package ships LFM3-VL's template)."""
    from transformers import Lfm3VlProcessor, Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    patching = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return Lfm3VlProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, **patching),
        video_processor=Qwen3VLVideoProcessor(**patching), tokenizer=qwen_tokenizer(),
        chat_template=chatml_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )


def lfm3_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 3) -> dict:
    """A tiny LFM3 language model: a short-convolution layer (window 3), a sliding-attention layer (window 8) and a
    full-attention layer (proportional RoPE), sandwich norms and attention gates as the checkpoints."""
    kinds = ["conv", "sliding_attention", "full_attention"]
    return {
        "model_type": "lfm3", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": max(layers, 3), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": (kinds * 2)[:max(layers, 3)], "sliding_window": 8, "conv_L_cache": 3,
        "initializer_range": initializer_range, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def _lfm3_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: a convolution layer then an attention layer (the checkpoints' pattern starts with two convolutions)."""
    from transformers import Lfm3VlConfig, Lfm3VlForConditionalGeneration

    config = Lfm3VlConfig(
        text_config=lfm3_text_config(len(processor.tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "num_key_value_heads": 2, "patch_size": 14,
                       "layer_types": ["conv", "full_attention"], "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        vision_start_token_id=processor.vision_start_token_id, vision_end_token_id=processor.vision_end_token_id,
        projector_hidden_size=64,
    )
    return Lfm3VlForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND4_BUILDERS = {
    "lfm3_vl": _Builder(
        _lfm3_vl_processor,
        _lfm3_vl_model,
        "Qwen tokenizer (its vision tokens) and ChatML instead of the checkpoint's (no package ships them); real "
        "Qwen2VLImageProcessor (as transformers maps lfm3_vl) and Lfm3VlProcessor; a tiny LFM3 text (conv, sliding, "
        "full attention) and a conv + attention vision tower",
    ),
    "kimi_k25": _Builder(
        _kimi_k25_processor,
        _kimi_k25_model,
        "Qwen tokenizer + Kimi's media tokens and ChatML instead of the checkpoint's (no package ships them); real "
        "Kimi_K25ImageProcessor (14-px patches merged 2x2, <= 64 patches) and Kimi_K25Processor; a tiny DeepSeek-V3 "
        "language model (MLA, YaRN, MoE)",
    ),
    "mistral4": _Builder(
        _mistral3_processor,
        _mistral4_model,
        "as mistral3 (Qwen tokenizer + Pixtral's image tokens, ChatML; real PixtralImageProcessor / PixtralProcessor), "
        "the language model a tiny Mistral 4 (MLA, YaRN + Llama-4 scaling, MoE)",
    ),
    "gemma4_unified": _Builder(
        _gemma4_unified_processor,
        _gemma4_unified_model,
        "Qwen tokenizer + Gemma 4's image / audio markup tokens instead of the checkpoint's; the official Gemma 4 "
        "template (TRL's gemma4_v5); real Gemma4UnifiedImageProcessor (4-px patches merged 2x2, <= 70 soft tokens) "
        "and Gemma4UnifiedProcessor; Gemma 4's tiny text without per-layer inputs",
    ),
    "video_llama_3": _Builder(
        _video_llama_3_processor,
        _video_llama_3_model,
        "Qwen tokenizer and ChatML instead of the checkpoint's (no package ships them); real VideoLlama3ImageProcessor "
        "(14-px patches, 2x2 merge, 56-112 px) and VideoLlama3Processor; Qwen2 text",
    ),
}
"""Round-4 families exact under packing (issue 47)."""

ROUND4_AUDIO_BUILDERS = {
    "qwen2_audio": _Builder(
        _qwen2_audio_processor,
        _qwen2_audio_model,
        "Qwen tokenizer + Qwen2-Audio's audio tokens instead of the checkpoint's; the official template "
        "(Qwen2AudioProcessor.default_chat_template); real WhisperFeatureExtractor (16 mel bins) and "
        "Qwen2AudioProcessor; Qwen2 text",
    ),
}
"""Round-4 audio LLMs (no image processor: proven on audio batches of their own, not by the image-batch harness)."""
