"""Tiny LightOnOCR (Pixtral vision, Qwen3 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ...data.chat import CHATML_TEMPLATE
from ..family_parts import HIDDEN, PIXTRAL_MERGE, PIXTRAL_PATCH, Builder, family_tokenizer, qwen2_text
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- LightOnOCR (Pixtral vision, Qwen3 text)

# As mistral3: images fit in 56 px, 7-px patches merged 2x2 (h/14 * w/14 image tokens, no break tokens). The real
# checkpoint's vocabulary is Qwen's, so its image tokens are Qwen's own (<|image_pad|>; the config takes its id).
_LIGHTON_TOKENS = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
                   "image_end_token": "<|vision_end|>"}


def _lighton_ocr_processor() -> ProcessorMixin:
    from transformers import LightOnOcrProcessor, PixtralImageProcessor

    patch = {"height": PIXTRAL_PATCH, "width": PIXTRAL_PATCH}
    return LightOnOcrProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 56}, patch_size=patch),
        tokenizer=family_tokenizer(_LIGHTON_TOKENS), patch_size=PIXTRAL_PATCH, spatial_merge_size=PIXTRAL_MERGE,
        chat_template=CHATML_TEMPLATE,
    )


def _lighton_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LightOnOcrConfig, LightOnOcrForConditionalGeneration

    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = LightOnOcrConfig(
        vision_config={"model_type": "pixtral", **TINY_VISION_TOWER, "head_dim": 16, "image_size": 56,
                       "patch_size": PIXTRAL_PATCH, "initializer_range": initializer_range},
        text_config={**text, "model_type": "qwen3", "head_dim": HIDDEN // 4},
        image_token_id=processor.image_token_id,
        spatial_merge_size=PIXTRAL_MERGE,
    )
    return LightOnOcrForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "lighton_ocr": Builder(
        _lighton_ocr_processor,
        _lighton_ocr_model,
        "Qwen tokenizer (the checkpoint's own vocabulary; image tokens named as its processor names them) and "
        "ChatML instead of the checkpoint's template; real PixtralImageProcessor (56-px longest edge, 7-px patches) "
        "and LightOnOcrProcessor; Qwen3 language model",
    ),
}
