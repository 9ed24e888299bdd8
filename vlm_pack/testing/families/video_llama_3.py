"""Tiny VideoLLaMA 3 (NaViT SigLIP tower + Qwen2 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, qwen2_text
from ..tiny_models import TINY_VISION_TOWER, qwen_tokenizer

__all__ = ["BUILDERS"]

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
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "patch_size": _VL3_PATCH, "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
    )
    return VideoLlama3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "video_llama_3": Builder(
        _video_llama_3_processor,
        _video_llama_3_model,
        "Qwen tokenizer and ChatML instead of the checkpoint's (no package ships them); real VideoLlama3ImageProcessor "
        "(14-px patches, 2x2 merge, 56-112 px) and VideoLlama3Processor; Qwen2 text",
    ),
}
