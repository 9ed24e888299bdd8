"""Tiny HunYuan-VL (4-axis rope, image ordinal per sample):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, mrope_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- HunYuan-VL (4-axis rope, image ordinal per sample)

# Images between 32x32 and 128x128 pixels: 16-px patches merged 2x2; each image's span is h * (w + 1) + 2 tokens.
# The special tokens are spelled as the checkpoint's; the rope is the checkpoints' fixed-alpha "dynamic" (NTK-alpha)
# split into 4 axes (sequence, width, height, image ordinal).
_HUNYUAN_TOKENS = {"image_token": "<｜hy_place▁holder▁no▁102｜>", "image_start_token": "<｜hy_place▁holder▁no▁100｜>",
                   "image_end_token": "<｜hy_place▁holder▁no▁101｜>"}


def _hunyuan_vl_processor() -> ProcessorMixin:
    from transformers import HunYuanVLImageProcessor, HunYuanVLProcessor

    tokens = _HUNYUAN_TOKENS
    return HunYuanVLProcessor(
        image_processor=HunYuanVLImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                                                patch_size=16, merge_size=2),
        tokenizer=family_tokenizer(tokens),
        chat_template=chatml_template(tokens["image_start_token"] + tokens["image_token"] + tokens["image_end_token"]),
    )


def _hunyuan_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

    tokenizer = processor.tokenizer
    text = mrope_text(processor, initializer_range, layers, [2, 2, 2, 2])
    # a small base, so the image-ordinal axis (the lowest frequencies) visibly turns per image
    text["rope_parameters"].update(rope_type="dynamic", alpha=1.0, factor=1.0, rope_theta=100.0)
    config = HunYuanVLConfig(
        text_config=text,
        vision_config={**TINY_VISION_TOWER, "patch_size": 16, "spatial_merge_size": 2, "out_hidden_size": HIDDEN,
                       "max_image_size": 128, "min_image_size": 32, "initializer_range": initializer_range},
        image_token_id=tokenizer.image_token_id, im_start_id=tokenizer.image_start_token_id,
        im_end_id=tokenizer.image_end_token_id,
    )
    return HunYuanVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "hunyuan_vl": Builder(
        _hunyuan_vl_processor,
        _hunyuan_vl_model,
        "Qwen tokenizer + HunYuan's image start/placeholder/end tokens (spelled as the checkpoint's) and ChatML "
        "instead of HunYuan's tokenizer and template (no package ships it); real HunYuanVLImageProcessor (32-128 px "
        "images) and HunYuanVLProcessor",
    ),
}
