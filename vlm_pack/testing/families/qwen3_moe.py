"""Tiny Qwen3-VL-MoE and Qwen3.5-MoE (mixture-of-experts MLPs; Qwen3.5: hybrid DeltaNet + full attention):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Qwen3-VL-MoE (Qwen3-VL with mixture-of-experts MLPs)


# The small Qwen tokenizer's vision token ids, copied from the base config (the MoE configs default to Qwen's own).
_QWEN_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _qwen3_vl_moe_processor() -> ProcessorMixin:
    from ..tiny_models import offline_qwen2vl_processor

    return offline_qwen2vl_processor()


def _qwen3_vl_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Qwen3-VL's tiny config (vlm_pack.testing.tiny_models) with 4 experts, 2 per token, in every decoder layer."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from ..tiny_models import tiny_config

    base = tiny_config("qwen3_vl", initializer_range=initializer_range, layers=layers)
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    config = Qwen3VLMoeConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "decoder_sparse_step": 1},
        vision_config={k: v for k, v in base.vision_config.to_dict().items() if k != "model_type"},
        **{key: getattr(base, key) for key in _QWEN_VISION_IDS},
    )
    return Qwen3VLMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qwen3.5-MoE (hybrid DeltaNet + full attention, MoE)


def _qwen3_5_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Qwen3.5's tiny config (vlm_pack.testing.tiny_models: DeltaNet and full-attention layers alternating, linear first)
    with 4 experts, 2 per token, plus the shared expert."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from ..tiny_models import tiny_config

    base = tiny_config("qwen3_5", initializer_range=initializer_range, layers=layers)
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    config = Qwen3_5MoeConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 32},
        vision_config={k: v for k, v in base.vision_config.to_dict().items() if k != "model_type"},
        **{key: getattr(base, key) for key in _QWEN_VISION_IDS},
    )
    return Qwen3_5MoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "qwen3_vl_moe": Builder(
        _qwen3_vl_moe_processor,
        _qwen3_vl_moe_model,
        "the offline Qwen2-VL processor of vlm_pack.testing.tiny_models (14-px patches), as the tiny Qwen3-VL uses",
    ),
    "qwen3_5_moe": Builder(
        _qwen3_vl_moe_processor,
        _qwen3_5_moe_model,
        "the offline Qwen2-VL processor of vlm_pack.testing.tiny_models (14-px patches), as the tiny Qwen3.5 uses",
    ),
}
