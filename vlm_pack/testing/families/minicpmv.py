"""Tiny MiniCPM-V 4.6 and 4.7 (NaViT slices, Qwen3.5 hybrid text; 4.7 positioned by Canvas M-RoPE):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer
from ..tiny_models import TINY_VISION_TOWER, hybrid_text_config, tiny_text_config

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- MiniCPM-V 4.6 (NaViT slices, Qwen3.5 hybrid text)

# 7-px patches, 56-px slices (8 x 8 patches -> 4 tokens after the 16x merge), up to 4 slices + the source image.
# The special tokens are spelled as the checkpoint's markup; the placeholder is the processor's image token.
_MINICPM_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
                   "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                   "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}


def _minicpmv4_6_processor() -> ProcessorMixin:
    from transformers import MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

    return MiniCPMV4_6Processor(
        image_processor=MiniCPMV4_6ImageProcessor(patch_size=7, scale_resolution=56, max_slice_nums=4),
        video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=family_tokenizer(_MINICPM_TOKENS),
        chat_template=chatml_template(_MINICPM_TOKENS["image_token"]),
    )


def _minicpmv4_6_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: 2 layers with the window-attention merger after layer 0; text: Qwen3.5 (DeltaNet + attention)."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration

    tokenizer = processor.tokenizer
    text = hybrid_text_config(tiny_text_config(initializer_range, layers, len(tokenizer)), layers)
    config = MiniCPMV4_6Config(
        text_config={**text, "model_type": "qwen3_5_text"},
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "image_size": 56, "patch_size": 7,
                       "initializer_range": initializer_range},
        insert_layer_id=0, image_size=56, image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id, initializer_range=initializer_range,
    )
    return MiniCPMV4_6ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- MiniCPM-V 4.7 (MiniCPM-V 4.6 + Canvas M-RoPE)

# As MiniCPM-V 4.6's tiny build (7-px patches, 56-px slices: 4 tokens each after the 16x merge, up to 4 slices +
# the source image); the processor class is 4.7's (it writes mm_token_type_ids, which the canvas is read from).


def _minicpmv4_7_processor() -> ProcessorMixin:
    from transformers import MiniCPMV4_7Processor
    from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

    return MiniCPMV4_7Processor(
        image_processor=MiniCPMV4_6ImageProcessor(patch_size=7, scale_resolution=56, max_slice_nums=4),
        video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=family_tokenizer(_MINICPM_TOKENS),
        chat_template=chatml_template(_MINICPM_TOKENS["image_token"]),
    )


def _minicpmv4_7_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: 2 layers with the window-attention merger after layer 0; text: Qwen3.5 (DeltaNet + attention) with
    interleaved mRoPE sections; the canvas markers' ids from the tokenizer, as the conversion script stores them."""
    from transformers import MiniCPMV4_7Config, MiniCPMV4_7ForConditionalGeneration

    tokenizer = processor.tokenizer
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    markers = {name.removesuffix("_token") + "_id": tokenizer.convert_tokens_to_ids(_MINICPM_TOKENS[name])
               for name in ("image_start_token", "image_end_token", "slice_start_token", "slice_end_token")}
    text = hybrid_text_config(tiny_text_config(initializer_range, layers, len(tokenizer)), layers)
    config = MiniCPMV4_7Config(
        text_config={**text, "model_type": "qwen3_5_text"},
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "image_size": 56, "patch_size": 7,
                       "initializer_range": initializer_range},
        insert_layer_id=0, image_size=56, image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id, initializer_range=initializer_range, newline_id=newline,
        **markers,
    )
    return MiniCPMV4_7ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "minicpmv4_6": Builder(
        _minicpmv4_6_processor,
        _minicpmv4_6_model,
        "Qwen tokenizer + MiniCPM-V's image/slice/image-id markup tokens and ChatML instead of the checkpoint's "
        "tokenizer and template (no package ships them); real MiniCPMV4_6ImageProcessor (7-px patches, 56-px slices, "
        "up to 4 + the source image) and MiniCPMV4_6Processor; Qwen3.5 hybrid text (DeltaNet + attention)",
    ),
    "minicpmv4_7": Builder(
        _minicpmv4_7_processor,
        _minicpmv4_7_model,
        "as minicpmv4_6 (Qwen tokenizer + MiniCPM-V's markup tokens, ChatML; real MiniCPMV4_6ImageProcessor, 7-px "
        "patches, 56-px slices, up to 4 + the source image), with MiniCPMV4_7Processor and the canvas marker ids "
        "(<image>, </image>, <slice>, </slice>, newline) read from that tokenizer; Qwen3.5 hybrid text with "
        "interleaved mRoPE sections",
    ),
}
