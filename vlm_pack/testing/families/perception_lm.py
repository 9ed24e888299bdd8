"""Tiny PerceptionLM (timm Perception Encoder + Llama, tile stacks):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- PerceptionLM (timm Perception Encoder + Llama)

# 32-px tiles of 16-px patches (4 tokens per tile, no pooling), a thumbnail plus up to 4 tiles per image; a one-block
# Perception Encoder (rope attention, class token dropped by the model).
_PLM_TILE = 32


def _perception_lm_processor() -> ProcessorMixin:
    from transformers import (AutoTokenizer, PerceptionLMImageProcessor, PerceptionLMProcessor,
                              PerceptionLMVideoProcessor)

    from ..tiny_models import small_qwen_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(
        small_qwen_tokenizer_path(), extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    return PerceptionLMProcessor(
        video_processor=PerceptionLMVideoProcessor(), tokenizer=tokenizer, patch_size=16, pooling_ratio=1,
        image_processor=PerceptionLMImageProcessor(tile_size=_PLM_TILE, max_num_tiles=4),
        chat_template=chatml_template("<|image|>"),
    )


def _perception_lm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import PerceptionLMConfig, PerceptionLMForConditionalGeneration

    config = PerceptionLMConfig(
        vision_config={"model_type": "timm_wrapper", "architecture": "vit_pe_core_tiny_patch16_384",
                       "model_args": {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": _PLM_TILE,
                                      "ref_feat_shape": [2, 2], "global_pool": ""}},
        text_config={"model_type": "llama", "vocab_size": len(processor.tokenizer), "hidden_size": HIDDEN,
                     "intermediate_size": 2 * HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id, projector_pooling_ratio=1,
    )
    return PerceptionLMForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "perception_lm": Builder(
        _perception_lm_processor, _perception_lm_model,
        "Qwen tokenizer + '<|image|>' / '<|video|>' and ChatML (no official PerceptionLM template is installed); real "
        "PerceptionLMImageProcessor (32-px tiles: thumbnail + up to 4) and PerceptionLMProcessor; a one-block timm "
        "Perception Encoder",
        own_proof=True,
    ),
}
