"""Tiny Mistral3 (Pixtral vision, Mistral text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import PIXTRAL_MERGE, PIXTRAL_PATCH, Builder, chatml_template, family_tokenizer, mistral_text_config
from ..tiny_models import TINY_VISION_TOWER

__all__ = ["BUILDERS", "mistral4_text_config"]

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


# ---------------------------------------------------------------- Mistral 4 (Mistral3 VLM, Mistral 4 MLA + MoE text)


def mistral4_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2) -> dict:
    """A tiny Mistral 4 language model: multi-head latent attention (low-rank q / kv, a decoupled 8-dim rope part,
    interleaved), YaRN RoPE with Llama-4 attention scaling by position (both left at the config's defaults, with
    an original context of 16 tokens so both bite inside our samples), a dense first layer then 4 routed experts (2
    per token) + a shared one."""
    from transformers import Mistral4Config

    config = Mistral4Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64,
        initializer_range=initializer_range, attention_dropout=0.0,
    )
    config.rope_parameters = {**config.rope_parameters, "original_max_position_embeddings": 16, "factor": 4.0}
    return config.to_dict()


def _mistral4_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Mistral3Config(
        vision_config={"model_type": "pixtral", **TINY_VISION_TOWER, "head_dim": 16, "image_size": 56,
                       "patch_size": PIXTRAL_PATCH, "initializer_range": initializer_range},
        text_config=mistral4_text_config(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=PIXTRAL_MERGE,
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
    "mistral4": Builder(
        _mistral3_processor,
        _mistral4_model,
        "as mistral3 (Qwen tokenizer + Pixtral's image tokens, ChatML; real PixtralImageProcessor / PixtralProcessor), "
        "the language model a tiny Mistral 4 (MLA, YaRN + Llama-4 scaling, MoE)",
    ),
}
