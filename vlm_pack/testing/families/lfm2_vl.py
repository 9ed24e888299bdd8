"""Tiny LFM2-VL (SigLIP2 NaFlex tiles, LFM2 conv + attention):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER, official_template

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- LFM2-VL (SigLIP2 NaFlex tiles, LFM2 conv + attention)

# 7-px patches unshuffled 2x2; images up to 16 tokens (3136 px) stay one tile, larger ones become 70-px crops (25
# tokens each, 2-4) plus a thumbnail (a 70-px tile's 100 patches also bound the thumbnails of 10:1 images, which
# the processor cannot stack beyond that). Text: a short-convolution layer (window 3) then an attention layer.
_LFM2_VL_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{row}_col_{col}|>" for row in range(1, 3) for col in range(1, 3)]


def _lfm2_vl_processor() -> ProcessorMixin:
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    return Lfm2VlProcessor(
        image_processor=Lfm2VlImageProcessor(encoder_patch_size=7, downsample_factor=2, tile_size=70,
                                             min_image_tokens=2, max_image_tokens=16, max_pixels_tolerance=1.0,
                                             min_tiles=2, max_tiles=4),
        tokenizer=family_tokenizer(_LFM2_VL_TOKENS),
        chat_template=official_template("lfm2_2_5_vl"),
    )


def _lfm2_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    kinds = (["conv", "full_attention"] * layers)[:layers]
    config = Lfm2VlConfig(
        text_config={**text, "model_type": "lfm2", "layer_types": kinds, "conv_L_cache": 3,
                     "block_auto_adjust_ff_dim": False},
        vision_config={"model_type": "siglip2_vision_model", **TINY_VISION_TOWER, "patch_size": 7, "num_patches": 16,
                       "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, projector_hidden_size=HIDDEN,
    )
    return Lfm2VlForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "lfm2_vl": Builder(
        _lfm2_vl_processor,
        _lfm2_vl_model,
        "Qwen tokenizer + LFM2-VL's image tokens instead of LFM2's; the official LFM2.5-VL chat template (TRL's "
        "lfm2_2_5_vl); real Lfm2VlImageProcessor (7-px patches, 28-px crops + thumbnail) and Lfm2VlProcessor; LFM2 "
        "text with one short-convolution and one attention layer",
    ),
}
