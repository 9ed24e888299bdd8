"""Tiny PaddleOCR-VL (NaViT SigLIP + ERNIE-4.5 text, 3-D rope):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer, mrope_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- PaddleOCR-VL (NaViT SigLIP + ERNIE-4.5 text, 3-D rope)

# Images between 28x28 and 112x112 pixels: 14-px patches merged 2x2 (1-16 image tokens), as Qwen2-VL's.
_PADDLE_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "vision_start": "<|IMAGE_START|>",
                  "vision_end": "<|IMAGE_END|>"}


def _paddleocr_vl_processor() -> ProcessorMixin:
    from transformers import PaddleOCRVLImageProcessor, PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(
        image_processor=PaddleOCRVLImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                                  patch_size=14, merge_size=2),
        tokenizer=family_tokenizer(_PADDLE_TOKENS),
        chat_template=chatml_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
    )


def _paddleocr_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    tokenizer = processor.tokenizer
    config = PaddleOCRVLConfig(
        text_config=mrope_text(processor, initializer_range, layers, [2, 3, 3]),
        vision_config={**TINY_VISION_TOWER, "image_size": 56, "patch_size": 14, "spatial_merge_size": 2,
                       "initializer_range": initializer_range},
        image_token_id=tokenizer.image_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|IMAGE_START|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|IMAGE_END|>"),
    )
    return PaddleOCRVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "paddleocr_vl": Builder(
        _paddleocr_vl_processor,
        _paddleocr_vl_model,
        "Qwen tokenizer + PaddleOCR's <|IMAGE_START|>/<|IMAGE_PLACEHOLDER|>/<|IMAGE_END|> tokens and ChatML instead "
        "of ERNIE's tokenizer and template (no package ships it); real PaddleOCRVLImageProcessor (28-112 px images) "
        "and PaddleOCRVLProcessor",
    ),
}
