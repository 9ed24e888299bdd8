"""Tiny Granite Docling (Idefics3-style page tiles):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Granite Docling (Idefics3-style page tiles)

# 28-px tiles of 7-px patches, pixel shuffle 2: 4 <image> tokens per tile, up to 4 tiles + the global view. One
# deepstack merger (vision layer 0); the coarse route only (as the 2B checkpoint).
_DOCLING_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 5) for col in range(1, 5)
]


def _granite_docling_processor() -> ProcessorMixin:
    from transformers.models.granite_docling.image_processing_granite_docling import GraniteDoclingImageProcessor
    from transformers.models.granite_docling.processing_granite_docling import GraniteDoclingProcessor

    return GraniteDoclingProcessor(
        image_processor=GraniteDoclingImageProcessor(size={"height": 28, "width": 28}, max_patches=4),
        tokenizer=family_tokenizer(_DOCLING_TOKENS), image_seq_len=4, chat_template=chatml_template("<image>"),
    )


def _granite_docling_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import GraniteDoclingConfig, GraniteDoclingForConditionalGeneration

    tokenizer = processor.tokenizer
    config = GraniteDoclingConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 7, "out_hidden_size": HIDDEN, "scale_factor": 2,
                       "deepstack_visual_indexes": [0], "use_fine_route": False,
                       "initializer_range": initializer_range},
        text_config={"vocab_size": len(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "initializer_range": initializer_range, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                     "attention_multiplier": 0.3, "logits_scaling": 2.0, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": None, "eos_token_id": None},
        image_token_id=processor.image_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return GraniteDoclingForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "granite_docling": Builder(
        _granite_docling_processor, _granite_docling_model,
        "Qwen tokenizer + Idefics3-style tile tokens and ChatML (no official Granite Docling template is installed); "
        "real GraniteDoclingImageProcessor (28-px tiles, up to 4 + global view) and GraniteDoclingProcessor",
        own_proof=True,
    ),
}
