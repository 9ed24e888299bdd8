"""Tiny InternVL and Qianfan-OCR (InternVL tiles; Qwen2 / Qwen3 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- InternVL

# 28-px tiles of 7-px patches, pixel-shuffled by 0.5: 4 image tokens per tile; up to 4 tiles + a thumbnail.
_INTERNVL_TILE = 28
_INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def _internvl_processor() -> ProcessorMixin:
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    size = {"height": _INTERNVL_TILE, "width": _INTERNVL_TILE}
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=4),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=family_tokenizer(_INTERNVL_TOKENS),
        image_seq_length=4,
        chat_template=chatml_template("<IMG_CONTEXT>"),
    )


def _internvl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tokenizer = processor.tokenizer
    config = InternVLConfig(
        vision_config={
            **TINY_VISION_TOWER,
            "image_size": [_INTERNVL_TILE, _INTERNVL_TILE],
            "patch_size": [7, 7],
            "initializer_range": initializer_range,
        },
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=4,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return InternVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qianfan-OCR (InternVL layout, Qwen3 text)

# As the tiny InternVL: 28-px tiles (up to 4 + a thumbnail) of 7-px patches, pixel-shuffled by 0.5: 4 tokens a tile.


def _qianfan_ocr_processor() -> ProcessorMixin:
    from transformers import GotOcr2ImageProcessor, QianfanOCRProcessor

    size = {"height": _INTERNVL_TILE, "width": _INTERNVL_TILE}
    return QianfanOCRProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=4),
        tokenizer=family_tokenizer({**_INTERNVL_TOKENS, "image_placeholder": "<image>"}),
        image_seq_length=4, chat_template=chatml_template("<image>"),
    )


def _qianfan_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import QianfanOCRConfig, QianfanOCRForConditionalGeneration

    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = QianfanOCRConfig(
        vision_config={**TINY_VISION_TOWER, "image_size": [_INTERNVL_TILE, _INTERNVL_TILE], "patch_size": [7, 7],
                       "initializer_range": initializer_range},
        text_config={**text, "model_type": "qwen3", "head_dim": HIDDEN // 4},
        image_token_id=processor.image_token_id, image_seq_length=4, downsample_ratio=0.5,
    )
    return QianfanOCRForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "internvl": Builder(
        _internvl_processor,
        _internvl_model,
        "Qwen tokenizer + '<img>'/'</img>'/'<IMG_CONTEXT>'/'<video>' tokens and ChatML instead of the checkpoint's; "
        "real GotOcr2ImageProcessor (28-px tiles, up to 4 + thumbnail) and InternVLProcessor",
    ),
    "qianfan_ocr": Builder(
        _qianfan_ocr_processor,
        _qianfan_ocr_model,
        "as internvl (Qwen tokenizer + InternVL's image tokens and ChatML writing the processor's <image> "
        "placeholder), with QianfanOCRProcessor and a Qwen3 language model",
    ),
}
