"""Tiny PaliGemma and PaliGemma 2 (SigLIP + Gemma / Gemma 2, prefix-LM):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- PaliGemma (SigLIP + Gemma, prefix-LM)

# 28-px images of 14-px patches: 4 <image> tokens per image; a 2-layer Gemma (no chat template: the processor's own
# prompt / suffix rule, vlm_pack.models.paligemma.encode_sample).
_PALIGEMMA_IMAGE = 28


def _paligemma_processor() -> ProcessorMixin:
    from transformers import PaliGemmaProcessor, SiglipImageProcessor

    from ..tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    image_processor = SiglipImageProcessor(size={"height": _PALIGEMMA_IMAGE, "width": _PALIGEMMA_IMAGE})
    image_processor.image_seq_length = (_PALIGEMMA_IMAGE // 14) ** 2
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)


# PaliGemma 2's Gemma 2: attention-logit and final softcapping small enough to bite on tiny scores, sliding layers
# (40 tokens: every prefix of the tests fits, the longest answers run past it), query_pre_attn_scalar != head_dim.
_GEMMA2_TEXT = {"model_type": "gemma2", "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                "sliding_window": 40, "query_pre_attn_scalar": 8}


def _paligemma_model(processor, initializer_range: float, layers: int, attn: str,
                     gemma2: bool = False) -> PreTrainedModel:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = PaliGemmaConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": _PALIGEMMA_IMAGE, "patch_size": 14, "projection_dim": HIDDEN},
        text_config={"model_type": "gemma", "vocab_size": len(tokenizer), "hidden_size": HIDDEN,
                     "intermediate_size": 2 * HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "initializer_range": initializer_range,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": None, **(_GEMMA2_TEXT if gemma2 else {})},
        image_token_id=processor.image_token_id, projection_dim=HIDDEN, pad_token_id=tokenizer.pad_token_id,
    )
    return PaliGemmaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "paligemma": Builder(
        _paligemma_processor, _paligemma_model,
        "Qwen tokenizer + '<bos>' and PaliGemma's '<image>' (added by the processor); no chat template: the "
        "processor's own prompt / suffix encoding; real SiglipImageProcessor (28 px: 4 image tokens) and "
        "PaliGemmaProcessor; a 2-layer Gemma",
        own_proof=True,
    ),
    "paligemma2": Builder(
        _paligemma_processor, lambda *args: _paligemma_model(*args, gemma2=True),
        "as paligemma, with a 2-layer Gemma 2 (one sliding layer of 40 tokens, one global; attention-logit softcap 2, "
        "final logit softcap 5, query_pre_attn_scalar 8): PaliGemma 2's language model",
        own_proof=True,
    ),
}
