"""Tiny LFM3-VL (conv + attention NaViT tower, LFM3 hybrid text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template
from ..tiny_models import TINY_VISION_TOWER, qwen_tokenizer

__all__ = ["BUILDERS", "lfm3_text_config"]

# ---------------------------------------------------------------- LFM3-VL (conv + attention tower, LFM3 text)


def _lfm3_vl_processor() -> ProcessorMixin:
    """Qwen2-VL's image processor (the one transformers maps lfm3_vl to): 14-px patches merged 2x2, 56-112 px;
    ChatML with Qwen's vision markers (no package ships LFM3-VL's template)."""
    from transformers import Lfm3VlProcessor, Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    patching = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return Lfm3VlProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, **patching),
        video_processor=Qwen3VLVideoProcessor(**patching), tokenizer=qwen_tokenizer(),
        chat_template=chatml_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )


def lfm3_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 3) -> dict:
    """A tiny LFM3 language model: a short-convolution layer (window 3), a sliding-attention layer (window 8) and a
    full-attention layer (proportional RoPE), sandwich norms and attention gates as the checkpoints."""
    kinds = ["conv", "sliding_attention", "full_attention"]
    return {
        "model_type": "lfm3", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": max(layers, 3), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": (kinds * 2)[:max(layers, 3)], "sliding_window": 8, "conv_L_cache": 3,
        "initializer_range": initializer_range, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def _lfm3_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Vision: a convolution layer then an attention layer (the checkpoints' pattern starts with two convolutions)."""
    from transformers import Lfm3VlConfig, Lfm3VlForConditionalGeneration

    config = Lfm3VlConfig(
        text_config=lfm3_text_config(len(processor.tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "num_hidden_layers": 2, "num_key_value_heads": 2, "patch_size": 14,
                       "layer_types": ["conv", "full_attention"], "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        vision_start_token_id=processor.vision_start_token_id, vision_end_token_id=processor.vision_end_token_id,
        projector_hidden_size=64,
    )
    return Lfm3VlForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "lfm3_vl": Builder(
        _lfm3_vl_processor,
        _lfm3_vl_model,
        "Qwen tokenizer (its vision tokens) and ChatML instead of the checkpoint's (no package ships them); real "
        "Qwen2VLImageProcessor (as transformers maps lfm3_vl) and Lfm3VlProcessor; a tiny LFM3 text (conv, sliding, "
        "full attention) and a conv + attention vision tower",
    ),
}
