"""Tiny LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video, VipLLaVA and Video-LLaVA (images):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import (
    LLAVA_CROP, LLAVA_PINPOINTS, Builder, chatml_template, family_tokenizer, llava_sizes, qwen2_text,
)
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

def _llava_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    return LlavaProcessor(
        image_processor=CLIPImageProcessor(**llava_sizes()), tokenizer=family_tokenizer(["<image>"]), patch_size=7,
        vision_feature_select_strategy="full", chat_template=chatml_template("<image>"),
    )


def _llava_next_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    return LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(**llava_sizes(), image_grid_pinpoints=LLAVA_PINPOINTS),
        tokenizer=family_tokenizer(["<image>"]), patch_size=7, vision_feature_select_strategy="full",
        chat_template=chatml_template("<image>"),
    )


def _llava_next_video_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor, LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor

    return LlavaNextVideoProcessor(
        image_processor=LlavaNextImageProcessor(**llava_sizes(), image_grid_pinpoints=LLAVA_PINPOINTS),
        video_processor=LlavaNextVideoVideoProcessor(**llava_sizes()),
        tokenizer=family_tokenizer(["<image>", "<video>"]), patch_size=7, vision_feature_select_strategy="full",
        chat_template=chatml_template("<image>"),
    )


def _llava_config(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by the LLaVA family: a SigLIP tower (no CLS: strategy "full"), a Qwen2 text model."""
    tokenizer = processor.tokenizer
    return {
        "vision_config": {"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": LLAVA_CROP,
                          "patch_size": 7},
        "text_config": qwen2_text(len(tokenizer), initializer_range, layers),
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "initializer_range": initializer_range,
    }


def _llava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(**_llava_config(processor, initializer_range, layers))
    return LlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _llava_next_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(**_llava_config(processor, initializer_range, layers),
                             image_grid_pinpoints=LLAVA_PINPOINTS)
    return LlavaNextForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _llava_next_video_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    config = LlavaNextVideoConfig(
        **_llava_config(processor, initializer_range, layers), image_grid_pinpoints=LLAVA_PINPOINTS,
        video_token_index=processor.tokenizer.convert_tokens_to_ids("<video>"),
    )
    return LlavaNextVideoForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _vipllava_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    # A CLIP tower (CLS token first, dropped by the model): 16 patch features per 28-px image.
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(**llava_sizes()), tokenizer=family_tokenizer(["<image>"]), patch_size=7,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chatml_template("<image>"),
    )


def _vipllava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """VipLLaVA: features of several vision layers (here the embeddings and the last of a 2-layer CLIP tower)
    concatenated and projected."""
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = VipLlavaConfig(
        vision_config={"model_type": "clip_vision_model", **TINY_VISION_TOWER, "num_hidden_layers": 2,
                       "image_size": LLAVA_CROP, "patch_size": 7, "projection_dim": 32},
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=[0, -1],
    )
    return VipLlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Video-LLaVA (images; videos refused)


def _video_llava_processor() -> ProcessorMixin:
    from transformers import VideoLlavaImageProcessor, VideoLlavaProcessor, VideoLlavaVideoProcessor

    return VideoLlavaProcessor(
        image_processor=VideoLlavaImageProcessor(**llava_sizes()),
        video_processor=VideoLlavaVideoProcessor(**llava_sizes()),
        tokenizer=family_tokenizer(["<image>", "<video>"]), patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chatml_template("<image>"),
    )


def _video_llava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import VideoLlavaConfig, VideoLlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = VideoLlavaConfig(
        vision_config={"model_type": "clip_vision_model", **TINY_VISION_TOWER, "image_size": LLAVA_CROP,
                       "patch_size": 7, "projection_dim": 32},
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1,
    )
    return VideoLlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "llava": Builder(
        _llava_processor,
        _llava_model,
        "Qwen tokenizer + '<image>' and ChatML instead of the checkpoint's; real CLIPImageProcessor (28-px crops) "
        "and LlavaProcessor; SigLIP tower (no CLS token) and Qwen2 language model",
    ),
    "llava_next": Builder(
        _llava_next_processor,
        _llava_next_model,
        "as llava, with LlavaNextImageProcessor (anyres 28-px crops, up to 2x2) and LlavaNextProcessor",
    ),
    "llava_next_video": Builder(
        _llava_next_video_processor,
        _llava_next_video_model,
        "as llava_next, with LlavaNextVideoProcessor (images only: videos are refused by the family)",
    ),
    "vipllava": Builder(
        _vipllava_processor,
        _vipllava_model,
        "as llava, with a CLIP tower (CLS token) and LlavaProcessor (as the VipLLaVA checkpoints ship)",
    ),
    "video_llava": Builder(
        _video_llava_processor,
        _video_llava_model,
        "as vipllava, with VideoLlavaImageProcessor / VideoLlavaProcessor (images only: videos are refused)",
    ),
}
