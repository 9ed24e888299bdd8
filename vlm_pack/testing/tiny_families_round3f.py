"""Tiny random models and offline processors for the round-3f VLM families (MiniCPM-V 4.7).

Built like ``vlm_pack.testing.tiny_families`` (whose builder registry includes these): the small Qwen tokenizer plus
the family's image tokens, the family's own image-processor and processor classes built from parameters (tiny
images), ChatML where no PyPI package ships the official chat template, and a tiny model built from a config object
(hidden 64, 1-2 layers, a small vision tower).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _Builder, _tokenizer, chatml_template
from .tiny_families_round3d import _MINICPM_TOKENS
from .tiny_models import TINY_VISION_TOWER, _hybrid_text_config, _text_config

__all__ = ["ROUND3F_BUILDERS"]


# ---------------------------------------------------------------- MiniCPM-V 4.7 (MiniCPM-V 4.6 + Canvas M-RoPE)

# As MiniCPM-V 4.6's tiny build (7-px patches, 56-px slices: 4 tokens each after the 16x merge, up to 4 slices +
# the source image); the processor class is 4.7's (it writes mm_token_type_ids, which the canvas is read from).


def _minicpmv4_7_processor() -> ProcessorMixin:
    from transformers import MiniCPMV4_7Processor
    from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

    return MiniCPMV4_7Processor(
        image_processor=MiniCPMV4_6ImageProcessor(patch_size=7, scale_resolution=56, max_slice_nums=4),
        video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=_tokenizer(_MINICPM_TOKENS),
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
    text = _hybrid_text_config(_text_config(initializer_range, layers, len(tokenizer)), layers)
    config = MiniCPMV4_7Config(
        text_config={**text, "model_type": "qwen3_5_text"},
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "image_size": 56, "patch_size": 7,
                       "initializer_range": initializer_range},
        insert_layer_id=0, image_size=56, image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id, initializer_range=initializer_range, newline_id=newline,
        **markers,
    )
    return MiniCPMV4_7ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND3F_BUILDERS = {
    "minicpmv4_7": _Builder(
        _minicpmv4_7_processor,
        _minicpmv4_7_model,
        "as minicpmv4_6 (Qwen tokenizer + MiniCPM-V's markup tokens, ChatML; real MiniCPMV4_6ImageProcessor, 7-px "
        "patches, 56-px slices, up to 4 + the source image), with MiniCPMV4_7Processor and the canvas marker ids "
        "(<image>, </image>, <slice>, </slice>, newline) read from that tokenizer; Qwen3.5 hybrid text with "
        "interleaved mRoPE sections",
    ),
}
