"""Tiny ERNIE 4.5 VL MoE (3-D rope, text and vision experts):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer, mrope_text

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- ERNIE 4.5 VL MoE (3-D rope, text and vision experts)

# As PaddleOCR-VL: 28-112 px images, 14-px patches merged 2x2. ERNIE's rope pairs height and width frequencies, so
# its mrope_section is (height, width, temporal) with height == width.
_ERNIE_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
                 "image_end_token": "<|IMAGE_END|>", "video_token": "<|VIDEO_PLACEHOLDER|>",
                 "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>"}


def _ernie4_5_vl_moe_processor() -> ProcessorMixin:
    from transformers import Ernie4_5_VLMoeImageProcessor, Ernie4_5_VLMoeProcessor
    from transformers.models.ernie4_5_vl_moe import Ernie4_5_VLMoeVideoProcessor

    return Ernie4_5_VLMoeProcessor(
        image_processor=Ernie4_5_VLMoeImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                                     patch_size=14, merge_size=2),
        tokenizer=family_tokenizer(_ERNIE_TOKENS),
        video_processor=Ernie4_5_VLMoeVideoProcessor(),
        chat_template=chatml_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
    )


def _ernie4_5_vl_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """A dense first layer, then MoE layers with 4 text and 4 vision experts (2 per token) plus a shared one."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Ernie4_5_VLMoeConfig(
        text_config={**mrope_text(processor, initializer_range, layers, [3, 3, 2]), "moe_intermediate_size": [32, 16],
                     "moe_k": 2, "moe_num_experts": 4, "moe_num_shared_experts": 1},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "initializer_range": initializer_range},
        **{f"{name[:-len('_token')]}_token_id": tokenizer.convert_tokens_to_ids(token)
           for name, token in _ERNIE_TOKENS.items()},
    )
    return Ernie4_5_VLMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "ernie4_5_vl_moe": Builder(
        _ernie4_5_vl_moe_processor,
        _ernie4_5_vl_moe_model,
        "Qwen tokenizer + ERNIE's image/video start, placeholder and end tokens and ChatML instead of ERNIE's "
        "tokenizer and template (no package ships it); real Ernie4_5_VLMoeImageProcessor (28-112 px images) and "
        "Ernie4_5_VLMoeProcessor",
    ),
}
