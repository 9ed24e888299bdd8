"""Tiny Mistral3 (Pixtral vision, Mistral text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import PIXTRAL_MERGE, PIXTRAL_PATCH, Builder, chatml_template, family_tokenizer, mistral_text_config
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

_PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def _mistral3_processor() -> ProcessorMixin:
    from transformers import PixtralImageProcessor, PixtralProcessor

    patch = {"height": PIXTRAL_PATCH, "width": PIXTRAL_PATCH}
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 56}, patch_size=patch),
        tokenizer=family_tokenizer(_PIXTRAL_TOKENS),
        patch_size=PIXTRAL_PATCH,
        spatial_merge_size=PIXTRAL_MERGE,
        chat_template=chatml_template("[IMG]"),
    )


def _mistral3_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            **TINY_VISION_TOWER,
            "head_dim": 16,
            "image_size": 56,
            "patch_size": PIXTRAL_PATCH,
            "initializer_range": initializer_range,
        },
        text_config=mistral_text_config(len(tokenizer), initializer_range, layers).to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=PIXTRAL_MERGE,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "mistral3": Builder(
        _mistral3_processor,
        _mistral3_model,
        "Qwen tokenizer + '[IMG]'/'[IMG_BREAK]'/'[IMG_END]' tokens and ChatML instead of Mistral's tekken "
        "tokenizer and template; real PixtralImageProcessor (56-px longest edge, 7-px patches) and PixtralProcessor",
    ),
}
