"""Tiny Llama 4 (chunked local attention, NoPE layers, MoE):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, family_tokenizer

__all__ = ["BUILDERS", "llama4_text_config"]

# ---------------------------------------------------------------- Llama 4

# 28-px tiles of 7-px patches, pixel shuffle 0.5: 4 <|patch|> tokens per tile; up to 4 tiles + the global view.
# Chunks of 8 tokens make the chunked layers bite inside every sample.
_LLAMA4_TOKENS = ["<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                  "<|tile_y_separator|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>",
                  "<|python_end|>"]
LLAMA4_CHUNK = 8


def _llama4_processor() -> ProcessorMixin:
    from transformers import Llama4ImageProcessor, Llama4Processor
    from transformers.models.llama4 import processing_llama4

    class Fp32Llama4ImageProcessor(Llama4ImageProcessor):
        """The real image processor, its bf16 pixel values (as the checkpoint's) handed on as fp32 for the fp32
        tiny model (the stock model does not cast them)."""

        def rescale_and_normalize(self, *args, **kwargs):
            return super().rescale_and_normalize(*args, **kwargs).float()

    tokenizer = family_tokenizer(_LLAMA4_TOKENS)
    tokenizer.chat_template = None
    return Llama4Processor(
        image_processor=Fp32Llama4ImageProcessor(size={"height": 28, "width": 28}, max_patches=4),
        tokenizer=tokenizer, patch_size=7, pixel_shuffle_ratio=0.5, chat_template=processing_llama4.chat_template,
    )


def llama4_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, **overrides) -> dict:
    """Tiny Llama 4 text: 2 layers (layer 0 chunked with RoPE, layer 1 full attention, NoPE, MoE of 2 experts)."""
    return {
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
        "intermediate_size_mlp": 2 * HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "num_local_experts": 2, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "attention_chunk_size": LLAMA4_CHUNK, "no_rope_layer_interval": 2,
        "initializer_range": initializer_range, "attention_dropout": 0.0, "bos_token_id": None,
        "eos_token_id": None, **overrides,
    }


def _llama4_model(processor, initializer_range: float, layers: int, attn: str, **text) -> PreTrainedModel:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Llama4Config(
        vision_config={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 7, "vision_output_dim": 32, "projector_input_dim": 32,
                       "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5, "initializer_range": initializer_range},
        text_config=llama4_text_config(len(tokenizer), initializer_range, layers,
                                       pad_token_id=tokenizer.pad_token_id, **text),
        image_token_index=tokenizer.convert_tokens_to_ids("<|patch|>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<|image_start|>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<|image_end|>"),
    )
    model = Llama4ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.language_model.register_forward_hook(_no_image_outputs)
    return model


def _no_image_outputs(module, args, output):
    """transformers 5.24's ``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` from its language
    model's output, which has none, and fails on every call (``return_dict=False`` included); this hook adds the
    missing attribute (None) so the stock forward completes. Nothing computed changes."""
    if not hasattr(output, "image_outputs"):
        output.image_outputs = None
    return output


BUILDERS = {
    "llama4": Builder(
        _llama4_processor, _llama4_model,
        "Qwen tokenizer + Llama 4's header and image tokens; the official Llama 4 chat template as transformers ships "
        "it (processing_llama4.chat_template); real Llama4ImageProcessor (28-px tiles, up to 4 + global view, its "
        "bf16 values cast to fp32) and Llama4Processor",
        own_proof=True,
    ),
}
