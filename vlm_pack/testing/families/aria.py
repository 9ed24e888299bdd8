"""Tiny Aria (Idefics3 tower, query projector, MoE text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Aria (Idefics3 tower, query projector, MoE text)

# Aria's processor accepts only max_image_size 490 or 980: 490-px images of 14-px patches (35 x 35), a projector
# whose 4 learned queries cross-attend to each image's patches: 4 <|img|> tokens per image. No image splitting.


def _aria_processor() -> ProcessorMixin:
    from transformers import AriaImageProcessor, AriaProcessor

    processor = AriaProcessor(image_processor=AriaImageProcessor(max_image_size=490, min_image_size=490),
                              tokenizer=family_tokenizer({"image_token": "<|img|>"}), size_conversion={490: 4},
                              chat_template=chatml_template("<|img|>"))
    processor.images_kwargs = {**AriaProcessor.images_kwargs, "max_image_size": 490}  # the class default is 980
    return processor


def _aria_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import AriaConfig, AriaForConditionalGeneration

    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = AriaConfig(
        text_config={**text, "model_type": "aria_text", "head_dim": HIDDEN // 4, "moe_num_experts": 4, "moe_topk": 2,
                     "moe_num_shared_experts": 1, "moe_intermediate_size": 32},
        vision_config={"model_type": "idefics3_vision", **TINY_VISION_TOWER, "image_size": 490, "patch_size": 14,
                       "initializer_range": initializer_range},
        projector_patch_to_query_dict={35 * 35: 4}, image_token_index=processor.image_token_id,
        initializer_range=initializer_range,
    )
    return AriaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "aria": Builder(
        _aria_processor,
        _aria_model,
        "Qwen tokenizer + Aria's <|img|> token and ChatML (the placeholder alone) instead of Aria's; real "
        "AriaImageProcessor (490-px images, no splitting) and AriaProcessor; MoE text with 4 experts, 2 per token",
    ),
}
