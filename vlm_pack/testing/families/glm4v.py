"""Tiny GLM-4V, GLM-4.5V (MoE), GLM-4.6V and GLM-OCR (3-D rope from the model's own get_rope_index):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- GLM-4V (3-D rope from the model's own get_rope_index)

_GLM4V_TOKENS = {
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "image_start_token": "<|begin_of_image|>",
    "image_end_token": "<|end_of_image|>",
    "video_start_token": "<|begin_of_video|>",
    "video_end_token": "<|end_of_video|>",
}


def _glm4v_processor() -> ProcessorMixin:
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    # Images between 56x56 and 112x112 pixels: 4-16 merged tokens of 14-px patches, 2x2 merge (like Qwen2-VL).
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2),
        video_processor=Glm4vVideoProcessor(),
        tokenizer=family_tokenizer(_GLM4V_TOKENS),
        chat_template=chatml_template("<|begin_of_image|><|image|><|end_of_image|>"),
    )


def _glm4v_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by GLM-4V and GLM-4V-MoE."""
    tokenizer = processor.tokenizer
    text = qwen2_text(len(tokenizer), initializer_range, layers)
    del text["model_type"]
    ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in _GLM4V_TOKENS.items()}
    return dict(
        text_config={
            **text,
            "head_dim": HIDDEN // 4,
            # GLM's partial rotary (half the head) split into (temporal, height, width) sections.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": HIDDEN,
            "num_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": initializer_range,
        },
        **ids,
    )


def _glm4v_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(**_glm4v_parts(processor, initializer_range, layers))
    return Glm4vForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _glm4v_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """GLM-4V's tiny config with GLM-4.5V's mixture of experts from the second layer on (the first stays dense):
    4 routed experts (sigmoid scores, 2 per token) plus a shared one."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    parts = _glm4v_parts(processor, initializer_range, layers)
    parts["text_config"].update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=32, first_k_dense_replace=1)
    config = Glm4vMoeConfig(**parts)
    return Glm4vMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- GLM-4.6V, GLM-OCR, VipLLaVA


def _glm46v_processor() -> ProcessorMixin:
    from transformers import Glm46VImageProcessor, Glm46VProcessor, Glm46VVideoProcessor

    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}  # as glm4v: 4-16 merged tokens per image
    return Glm46VProcessor(
        image_processor=Glm46VImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2),
        video_processor=Glm46VVideoProcessor(),
        tokenizer=family_tokenizer(_GLM4V_TOKENS),
        chat_template=chatml_template("<|begin_of_image|><|image|><|end_of_image|>"),
    )


def _glm46v_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    config = Glm46VConfig(**_glm4v_parts(processor, initializer_range, layers))
    return Glm46VForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _glm_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """GLM-4V's tiny config with GLM-OCR's classes (its vision tower: no absolute position embedding, q/k norms)."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration

    config = GlmOcrConfig(**_glm4v_parts(processor, initializer_range, layers))
    return GlmOcrForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "glm4v": Builder(
        _glm4v_processor,
        _glm4v_model,
        "Qwen tokenizer + GLM's <|begin_of_image|>/<|image|>/<|end_of_image|> (and video) tokens and ChatML "
        "instead of GLM's; real Glm4vImageProcessor (56-112 px images) and Glm4vProcessor",
    ),
    "glm4v_moe": Builder(
        _glm4v_processor,
        _glm4v_moe_model,
        "as glm4v (GLM-4.5V ships Glm4vProcessor)",
    ),
    "glm46v": Builder(
        _glm46v_processor,
        _glm46v_model,
        "as glm4v, with Glm46VImageProcessor / Glm46VProcessor",
    ),
    "glm_ocr": Builder(
        _glm46v_processor,
        _glm_ocr_model,
        "as glm46v (GLM-OCR ships Glm46VProcessor)",
    ),
}
