"""Tiny Ovis 2 (visual vocabulary, tiles, Qwen2 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Ovis 2 (visual vocabulary, tiles, Qwen2 text)

# 28-px tiles (up to 4 + a thumbnail) of 7-px patches, pixel-shuffled by hidden_stride 2: 4 <IMG_ATOM> per tile.
# The indicator tokens are added in the checkpoint's order (config.visual_indicator_token_ids follows it).
_OVIS2_TOKENS = ["<image>", "<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]


def _ovis2_processor() -> ProcessorMixin:
    from transformers import Ovis2ImageProcessor, Ovis2Processor

    return Ovis2Processor(
        image_processor=Ovis2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4),
        tokenizer=family_tokenizer(_OVIS2_TOKENS), image_seq_length=4, chat_template=chatml_template("<image>"),
    )


def _ovis2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Ovis2Config, Ovis2ForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids(_OVIS2_TOKENS)
    config = Ovis2Config(
        text_config=qwen2_text(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "image_size": 28, "patch_size": 7, "hidden_stride": 2, "vocab_size": 32,
                       "initializer_range": initializer_range},
        image_token_id=ids[1], visual_indicator_token_ids=ids[2:], vocab_size=len(tokenizer), hidden_size=HIDDEN,
    )
    return Ovis2ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "ovis2": Builder(
        _ovis2_processor,
        _ovis2_model,
        "Qwen tokenizer + Ovis's <image>, <IMG_ATOM> and indicator tokens and ChatML instead of the checkpoint's "
        "(no package ships its template); real Ovis2ImageProcessor (28-px tiles, up to 4 + a thumbnail) and "
        "Ovis2Processor; Qwen2 language model",
    ),
}
