"""Tiny DeepSeek-VL and DeepSeek-VL-Hybrid (SigLIP, a SAM tower for the hybrid, Llama text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- DeepSeek-VL (SigLIP, Llama text)

# Images resized (longest edge) and padded to 28x28 squares of 7-px patches: 16 <image_placeholder> tokens each.
_DEEPSEEK_VL_SIDE = 28


def _deepseek_vl_processor() -> ProcessorMixin:
    from transformers import DeepseekVLImageProcessor, DeepseekVLProcessor

    return DeepseekVLProcessor(
        image_processor=DeepseekVLImageProcessor(size={"height": _DEEPSEEK_VL_SIDE, "width": _DEEPSEEK_VL_SIDE}),
        tokenizer=family_tokenizer({"image_token": "<image_placeholder>"}),
        num_image_tokens=(_DEEPSEEK_VL_SIDE // 7) ** 2,
        chat_template=chatml_template("<image_placeholder>"),
    )


def _deepseek_vl_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config fields both DeepSeek-VL families share: a SigLIP tower on 28-px squares and a Llama language model."""
    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    return {
        "vision_config": {"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": _DEEPSEEK_VL_SIDE,
                          "patch_size": 7},
        "text_config": {**text, "model_type": "llama", "head_dim": HIDDEN // 4},
        "image_token_id": processor.image_token_id,
    }


def _deepseek_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import DeepseekVLConfig, DeepseekVLForConditionalGeneration

    config = DeepseekVLConfig(**_deepseek_vl_parts(processor, initializer_range, layers))
    return DeepseekVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# DeepSeek-VL-Hybrid adds a SAM tower on 56-px squares (7-px patches, 4-px windows, its one layer global) whose
# features are resized to the SigLIP grid: still 16 tokens per image.
_DEEPSEEK_VL_HIGH_RES = 56


def _deepseek_vl_hybrid_processor() -> ProcessorMixin:
    from transformers import DeepseekVLHybridImageProcessor, DeepseekVLHybridProcessor

    side, high = _DEEPSEEK_VL_SIDE, _DEEPSEEK_VL_HIGH_RES
    return DeepseekVLHybridProcessor(
        image_processor=DeepseekVLHybridImageProcessor(size={"height": side, "width": side},
                                                       high_res_size={"height": high, "width": high}),
        tokenizer=family_tokenizer({"image_token": "<image_placeholder>"}),
        num_image_tokens=(side // 7) ** 2,
        chat_template=chatml_template("<image_placeholder>"),
    )


def _deepseek_vl_hybrid_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import DeepseekVLHybridConfig, DeepseekVLHybridForConditionalGeneration

    config = DeepseekVLHybridConfig(
        **_deepseek_vl_parts(processor, initializer_range, layers),
        high_res_vision_config={"model_type": "sam_vision_model", "hidden_size": 32, "output_channels": 16,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": _DEEPSEEK_VL_HIGH_RES,
                                "patch_size": 7, "window_size": 4, "global_attn_indexes": [0], "num_pos_feats": 16,
                                "mlp_dim": 64, "initializer_range": initializer_range},
    )
    model = DeepseekVLHybridForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                                  dtype=torch.float32)
    with torch.no_grad():  # initialised to 0, which would leave the SAM global-attention branch out of the proof
        model.model.high_res_vision_alpha.fill_(1.0)
    return model


BUILDERS = {
    "deepseek_vl": Builder(
        _deepseek_vl_processor,
        _deepseek_vl_model,
        "Qwen tokenizer + '<image_placeholder>' and ChatML instead of DeepSeek's; real DeepseekVLImageProcessor "
        "(28-px padded squares) and DeepseekVLProcessor; SigLIP tower and Llama language model",
    ),
    "deepseek_vl_hybrid": Builder(
        _deepseek_vl_hybrid_processor,
        _deepseek_vl_hybrid_model,
        "as deepseek_vl, with DeepseekVLHybridImageProcessor (28-px and 56-px padded squares) / "
        "DeepseekVLHybridProcessor and a one-layer SAM tower",
    ),
}
