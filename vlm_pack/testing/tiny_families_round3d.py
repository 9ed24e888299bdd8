"""Tiny random models and offline processors for the round-3d VLM families (MiniCPM-V 4.6).

Built like ``vlm_pack.testing.tiny_families`` (whose builder registry includes these): the small Qwen tokenizer plus
the family's image tokens, the family's own image-processor and processor classes built from parameters (tiny
images), ChatML where no PyPI package ships the official chat template (said per family), and a tiny model built
from a config object (hidden 64, 1-2 layers, a small vision tower).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _Builder, _tokenizer, chatml_template
from .tiny_models import TINY_VISION_TOWER, _hybrid_text_config, _text_config

__all__ = ["ROUND3D_BUILDERS"]


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
        video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=_tokenizer(_MINICPM_TOKENS),
        chat_template=chatml_template(_MINICPM_TOKENS["image_token"]),
    )


def _minicpmv4_6_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: 2 layers with the window-attention merger after layer 0; text: Qwen3.5 (DeltaNet + attention)."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration

    tokenizer = processor.tokenizer
    text = _hybrid_text_config(_text_config(initializer_range, layers, len(tokenizer)), layers)
    config = MiniCPMV4_6Config(
        text_config={**text, "model_type": "qwen3_5_text"},
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "image_size": 56, "patch_size": 7,
                       "initializer_range": initializer_range},
        insert_layer_id=0, image_size=56, image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id, initializer_range=initializer_range,
    )
    return MiniCPMV4_6ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND3D_BUILDERS = {
    "minicpmv4_6": _Builder(
        _minicpmv4_6_processor,
        _minicpmv4_6_model,
        "Qwen tokenizer + MiniCPM-V's image/slice/image-id markup tokens and ChatML instead of the checkpoint's "
        "tokenizer and template (no package ships them); real MiniCPMV4_6ImageProcessor (7-px patches, 56-px slices, "
        "up to 4 + the source image) and MiniCPMV4_6Processor; Qwen3.5 hybrid text (DeltaNet + attention)",
    ),
}
"""Round-3d VLM families exact under packing (issue 39)."""
