"""Tiny Molmo 2 (overlapping crops, pooled patches, Qwen3-like text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Molmo 2 (overlapping crops, pooled patches, Qwen3-like text)

# 28-px crops of 7-px patches (4 x 4 patches; 1-patch overlap margins, so each crop adds a 2 x 2 patch window),
# pooled 2 x 2: the low-res view is 4 tokens, the high-res canvas (up to 4 crops) (tiling + 1)^2-ish tokens.
# The placeholder is the processor's <|image|>; the model's image token is <im_patch> (config.image_patch_id).
_MOLMO2_CROP, _MOLMO2_PATCH = 28, 7
_MOLMO2_TOKENS = {"image_token": "<|image|>", "video_token": "<|video|>", "im_patch_token": "<im_patch>",
                  "im_col_token": "<im_col>", "im_start_token": "<im_start>", "low_res_im_start_token":
                  "<low_res_im_start>", "frame_start_token": "<frame_start>", "im_end_token": "<im_end>",
                  "frame_end_token": "<frame_end>", "im_low_token": "<im_low>"}


def _molmo2_processor() -> ProcessorMixin:
    from transformers import Molmo2Processor
    from transformers.models.molmo2 import Molmo2ImageProcessor, Molmo2VideoProcessor

    size = {"height": _MOLMO2_CROP, "width": _MOLMO2_CROP}
    return Molmo2Processor(
        image_processor=Molmo2ImageProcessor(size=size, patch_size=_MOLMO2_PATCH, max_crops=4,
                                             overlap_margins=[1, 1], pooling_size=[2, 2]),
        video_processor=Molmo2VideoProcessor(size=size, patch_size=_MOLMO2_PATCH, pooling_size=[2, 2]),
        tokenizer=family_tokenizer(_MOLMO2_TOKENS), chat_template=chatml_template(_MOLMO2_TOKENS["image_token"]),
    )


def _molmo2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: 2 layers (both fed to the adapter, as the checkpoint feeds two); text: Molmo 2's (qwen3 q/k norm)."""
    from transformers import Molmo2Config, Molmo2ForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_start_token_id", "<im_start>"), ("low_res_image_start_token_id", "<low_res_im_start>"),
        ("image_end_token_id", "<im_end>"), ("image_patch_id", "<im_patch>"),
        ("frame_start_token_id", "<frame_start>"), ("frame_end_token_id", "<frame_end>"))}
    vision = {**TINY_VISION_TOWER, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
              "image_size": [_MOLMO2_CROP, _MOLMO2_CROP], "patch_size": _MOLMO2_PATCH,
              "initializer_range": initializer_range}
    adapter = {"vision_feature_layer": [-1, 0], "hidden_size": vision["hidden_size"], "num_attention_heads": 2,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 2 * HIDDEN, "text_hidden_size": HIDDEN,
               "initializer_range": initializer_range}
    text = {"vocab_size": len(tokenizer), "additional_vocab_size": 0, "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "initializer_range": initializer_range,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    config = Molmo2Config(vision_config=vision, adapter_config=adapter, text_config=text,
                          initializer_range=initializer_range, **ids)
    return Molmo2ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "molmo2": Builder(
        _molmo2_processor,
        _molmo2_model,
        "Qwen tokenizer + Molmo 2's image / crop / frame tokens and ChatML instead of the checkpoint's tokenizer and "
        "template (no package ships them); real Molmo2ImageProcessor (7-px patches, 28-px overlapping crops, up to 4 "
        "+ the low-res view, 2x2 pooling) and Molmo2Processor; Molmo 2's own text model (qwen3 q/k norm)",
    ),
}
