"""Tiny Kimi K2.5 (MoonViT-style tower + DeepSeek-V3 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS", "deepseek_v3_text_config"]

# ---------------------------------------------------------------- Kimi K2.5 (MoonViT-style tower + DeepSeek-V3 text)

_KIMI_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}


def _kimi_k25_processor() -> ProcessorMixin:
    """14-px patches merged 2x2, at most 64 patches (16 tokens) an image."""
    from transformers import Kimi_K25Processor
    from transformers.models.kimi_k25 import Kimi_K25ImageProcessor, Kimi_K25VideoProcessor

    return Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(patch_size=14, merge_size=2, max_patches=64),
        video_processor=Kimi_K25VideoProcessor(patch_size=14, merge_size=2), tokenizer=family_tokenizer(_KIMI_TOKENS),
        chat_template=chatml_template(_KIMI_TOKENS["image_token"]),
    )


def deepseek_v3_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2) -> dict:
    """A tiny DeepSeek-V3 language model: multi-head latent attention, YaRN RoPE (original context 16 tokens, so it
    bites inside our samples), a dense first layer then 4 routed experts (2 per token, one group) + a shared one."""
    return {
        "model_type": "deepseek_v3", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "max_position_embeddings": 64, "initializer_range": initializer_range,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "beta_fast": 32.0, "beta_slow": 1.0},
    }


def _kimi_k25_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Kimi_K25Config(
        text_config=deepseek_v3_text_config(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "patch_size": 14, "pos_emb_height": 16, "pos_emb_width": 16,
                       "initializer_range": initializer_range},
        projection_hidden_size=32, image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        tie_word_embeddings=False,
    )
    return Kimi_K25ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "kimi_k25": Builder(
        _kimi_k25_processor,
        _kimi_k25_model,
        "Qwen tokenizer + Kimi's media tokens and ChatML instead of the checkpoint's (no package ships them); real "
        "Kimi_K25ImageProcessor (14-px patches merged 2x2, <= 64 patches) and Kimi_K25Processor; a tiny DeepSeek-V3 "
        "language model (MLA, YaRN, MoE)",
    ),
}
