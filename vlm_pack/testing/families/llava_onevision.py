"""Tiny LLaVA-OneVision (anyres crops):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- LLaVA-OneVision

# 28-px crops of 7-px patches: 16 tokens per crop. Pinpoints up to 3 crops a side; "anyres_max_2" makes larger
# grids interpolate down (the model's own resize path), so the test covers it.
_OV_CROP = 28
_OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84]]
_OV_ASPECT = "anyres_max_2"


def _llava_onevision_processor() -> ProcessorMixin:
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    tokenizer = family_tokenizer(["<image>", "<video>"])
    template = chatml_template("<image>")
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": _OV_CROP, "width": _OV_CROP}, image_grid_pinpoints=_OV_PINPOINTS
        ),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": _OV_CROP, "width": _OV_CROP}),
        tokenizer=tokenizer,
        num_image_tokens=(_OV_CROP // 7) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=_OV_ASPECT,
        chat_template=template,
    )


def _llava_onevision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tokenizer = processor.tokenizer
    config = LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            **TINY_VISION_TOWER,
            "image_size": _OV_CROP,
            "patch_size": 7,
        },
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=_OV_PINPOINTS,
        vision_aspect_ratio=_OV_ASPECT,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        initializer_range=initializer_range,
    )
    return LlavaOnevisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "llava_onevision": Builder(
        _llava_onevision_processor,
        _llava_onevision_model,
        "Qwen tokenizer + '<image>'/'<video>' tokens and ChatML instead of the checkpoint's; real "
        "LlavaOnevisionImageProcessor (28-px crops, anyres pinpoints) and LlavaOnevisionProcessor",
    ),
}
