"""Tiny Gemma 4 unified (encoder-free: patches embedded per patch, Gemma 4 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, family_tokenizer
from ..tiny_models import official_template, tiny_config

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Gemma 4 unified (encoder-free patch embedder)

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


    patching = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}
    return Gemma4UnifiedProcessor(
        feature_extractor=Gemma4UnifiedAudioFeatureExtractor(), image_processor=Gemma4UnifiedImageProcessor(**patching),
        video_processor=Gemma4UnifiedVideoProcessor(**patching), tokenizer=family_tokenizer(_GEMMA4_UNIFIED_TOKENS),
        chat_template=official_template("gemma4_v5"),
    )


def _gemma4_unified_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Gemma 4's tiny text (key-equals-value full layers, final softcapping; no per-layer inputs nor MoE, which the
    unified model drops) with a sliding window of 72 tokens (at least an image's 70, as the family needs, and shorter
    than the edge batch's samples) and the encoder-free embedder."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration


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


BUILDERS = {
    "gemma4_unified": Builder(
        _gemma4_unified_processor,
        _gemma4_unified_model,
        "Qwen tokenizer + Gemma 4's image / audio markup tokens instead of the checkpoint's; the official Gemma 4 "
        "template (TRL's gemma4_v5); real Gemma4UnifiedImageProcessor (4-px patches merged 2x2, <= 70 soft tokens) "
        "and Gemma4UnifiedProcessor; Gemma 4's tiny text without per-layer inputs",
    ),
}
