"""Tiny Aya Vision and Cohere 2 Vision (SigLIP tiles, Cohere 2 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS", "cohere2_text_config"]

# ---------------------------------------------------------------- Aya Vision (SigLIP tiles, Cohere 2 text)

# 28-px tiles (up to 4 + a global view) of 7-px patches, pixel-shuffled by 2: 4 <|IMG_PATCH|> tokens per tile.
_AYA_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]


def cohere2_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, sliding_window: int = 4):
    """A fresh tiny ``Cohere2Config``: sliding-window layers with RoPE and full layers without (alternating)."""
    from transformers import Cohere2Config

    text = qwen2_text(vocab_size, initializer_range, layers)
    del text["model_type"]
    return Cohere2Config(**text, sliding_window=sliding_window, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


def _aya_vision_processor() -> ProcessorMixin:
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessor

    return AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True,
                                              min_patches=1, max_patches=4),
        tokenizer=family_tokenizer(_AYA_TOKENS), patch_size=7, img_size=28, downsample_factor=2,
        chat_template=chatml_template("<image>"),
    )


def _aya_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    config = AyaVisionConfig(
        vision_config={"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": 28, "patch_size": 7},
        text_config=cohere2_text_config(len(processor.tokenizer), initializer_range, layers).to_dict(),
        image_token_index=processor.image_token_id,
        downsample_factor=2,
    )
    return AyaVisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Cohere 2 Vision (Command A Vision)

# 28-px tiles (up to 4 + a thumbnail) of 7-px SigLIP patches, pixel-shuffled by 2: 2x2 = 4 image tokens per tile.
_COHERE2_VISION_TOKENS = {
    "boi_token": "<|START_OF_IMG|>",
    "eoi_token": "<|END_OF_IMG|>",
    "image_token": "<|IMG_PATCH|>",
    "img_line_break_token": "<|IMG_LINE_BREAK|>",
}


def _cohere2_vision_processor() -> ProcessorMixin:
    from transformers import Cohere2VisionImageProcessor, Cohere2VisionProcessor

    return Cohere2VisionProcessor(
        image_processor=Cohere2VisionImageProcessor(size={"height": 28, "width": 28}, patch_size=2, max_patches=4),
        tokenizer=family_tokenizer(_COHERE2_VISION_TOKENS),
        chat_template=chatml_template("<|IMG_PATCH|>"),
    )


def _cohere2_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    config = Cohere2VisionConfig(
        vision_config={"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": 28, "patch_size": 7},
        text_config=cohere2_text_config(len(processor.tokenizer), initializer_range, layers).to_dict(),
        image_token_id=processor.image_token_id,
        downsample_factor=2,
        alignment_intermediate_size=64,
    )
    return Cohere2VisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "aya_vision": Builder(
        _aya_vision_processor,
        _aya_vision_model,
        "Qwen tokenizer + Aya's image tokens and ChatML instead of Cohere's; real GotOcr2ImageProcessor (28-px "
        "tiles, up to 4 + a global view) and AyaVisionProcessor; Cohere 2 text (window 4)",
    ),
    "cohere2_vision": Builder(
        _cohere2_vision_processor,
        _cohere2_vision_model,
        "Qwen tokenizer + Cohere's image tokens and ChatML instead of Cohere's; real Cohere2VisionImageProcessor "
        "(28-px tiles, up to 4 + a thumbnail) and Cohere2VisionProcessor; Cohere 2 text (window 4)",
    ),
}
