"""Tiny HyperCLOVA X Vision V2 (Qwen2.5-VL windowed vision tower + HyperCLOVA X text, Granite-style multipliers):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, qwen2_text
from ..tiny_models import qwen_tokenizer, qwen_vision_patching

__all__ = ["BUILDERS"]


def _hyperclovax_vision_v2_processor() -> ProcessorMixin:
    """Qwen2-VL's image processor (14-px patches merged 2x2, 56-112 px) and the Qwen vocabulary's image token."""
    from transformers import HyperCLOVAXVisionV2Processor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    patching = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return HyperCLOVAXVisionV2Processor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, **patching),
        video_processor=Qwen2VLVideoProcessor(**patching), tokenizer=qwen_tokenizer(),
        chat_template=chatml_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )


def _hyperclovax_vision_v2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: Qwen2.5-VL's tiny tower (a windowed block, 56-px windows, then a full one); text: HyperCLOVA X with
    embedding / residual / attention multipliers and logit scaling away from 1."""
    from transformers import HyperCLOVAXVisionV2Config, HyperCLOVAXVisionV2ForConditionalGeneration

    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": HIDDEN, "intermediate_size": 64, "num_heads": 2,
              "window_size": 56, "fullatt_block_indexes": [1]}
    text = {**qwen2_text(len(processor.tokenizer), initializer_range, layers), "model_type": "hyperclovax",
            "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
            "logits_scaling": 4.0}
    config = HyperCLOVAXVisionV2Config(
        text_config=text, vision_config={**qwen_vision_patching(vision, initializer_range), "model_type": "qwen2_5_vl"},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
    )
    return HyperCLOVAXVisionV2ForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                                    dtype=torch.float32)


BUILDERS = {
    "hyperclovax_vision_v2": Builder(
        _hyperclovax_vision_v2_processor,
        _hyperclovax_vision_v2_model,
        "Qwen tokenizer (its vision tokens) and ChatML instead of the checkpoint's (no package ships them); real "
        "Qwen2VLImageProcessor and HyperCLOVAXVisionV2Processor; Qwen2.5-VL's tiny vision tower; a tiny HyperCLOVA X "
        "text (Granite-style multipliers, logit scaling)",
    ),
}
