"""Tiny Mllama (Llama 3.2 Vision: cross-attention layers):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Mllama (Llama 3.2 Vision)

# 28-px tiles of 7-px patches (16 patches + CLS per tile), up to 4 tiles per image; text layers: 0 self-attention,
# 1 cross-attention (2 layers), or 0 self, 1 cross, 2 self (3 layers). The gates that a fresh model zeroes (cross-
# attention and tile-embedding gates: the layers would be no-ops) get random values, so every path counts.


def _mllama_processor() -> ProcessorMixin:
    from transformers import MllamaImageProcessor, MllamaProcessor

    tokenizer = family_tokenizer(["<|image|>", "<|begin_of_text|>"])
    tokenizer.bos_token = "<|begin_of_text|>"
    return MllamaProcessor(
        image_processor=MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=4),
        tokenizer=tokenizer, chat_template="{{- bos_token -}}" + chatml_template("<|image|>"),
    )


def _mllama_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = MllamaConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                       "attention_heads": 2, "image_size": 28, "patch_size": 7, "max_num_tiles": 4,
                       "intermediate_layers_indices": [0], "vision_output_dim": 64,
                       "initializer_range": initializer_range},
        text_config={"vocab_size": len(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                     "num_hidden_layers": layers + 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "cross_attention_layers": [1], "initializer_range": initializer_range,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": None,
                     "pad_token_id": tokenizer.pad_token_id},
        image_token_index=processor.image_token_id,
    )
    model = MllamaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "gate" in name.rsplit(".", 1)[-1] and not parameter.any():
                parameter.uniform_(-1.0, 1.0)
    return model


BUILDERS = {
    "mllama": Builder(
        _mllama_processor, _mllama_model,
        "Qwen tokenizer + '<|image|>' / '<|begin_of_text|>' and ChatML after the BOS (no official Llama 3.2 Vision "
        "template is installed; TRL's llama3_2 is text-only); real MllamaImageProcessor (28-px tiles, up to 4) "
        "and MllamaProcessor; the gates a fresh model zeroes set at random",
        own_proof=True,
    ),
}
