"""Tiny Phi-4-multimodal (SigLIP crops, longrope text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Phi-4-multimodal

# The image processor counts tokens for 448-px crops of 14-px patches only (256 + 16 per crop, hard-coded), so the
# tiny tower keeps that geometry (hidden 32, 1 layer); dynamic_hd=2: a global view plus up to 2 crops.


def _phi4_multimodal_processor() -> ProcessorMixin:
    from transformers import (AutoTokenizer, Phi4MultimodalFeatureExtractor, Phi4MultimodalImageProcessor,
                              Phi4MultimodalProcessor)

    from ..tiny_models import small_qwen_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(
        small_qwen_tokenizer_path(), extra_special_tokens={"image_token": "<|image|>", "audio_token": "<|audio|>"})
    return Phi4MultimodalProcessor(Phi4MultimodalImageProcessor(dynamic_hd=2), Phi4MultimodalFeatureExtractor(),
                                   tokenizer, chat_template=chatml_template("<|image|>"))


def _phi4_multimodal_model(processor, initializer_range: float, layers: int, attn: str,
                           original_max_position_embeddings: int = 4096) -> PreTrainedModel:
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    tokenizer = processor.tokenizer
    half = HIDDEN // 4 // 2  # longrope factors: one per rotary frequency
    config = Phi4MultimodalConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None,
        max_position_embeddings=4 * original_max_position_embeddings,
        original_max_position_embeddings=original_max_position_embeddings,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 8 for i in range(half)],
                         "long_factor": [2.0 + i for i in range(half)],
                         "original_max_position_embeddings": original_max_position_embeddings},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 448, "patch_size": 14, "crop_size": 448, "feature_layer": -1,
                       "image_token_id": processor.image_token_id},
        audio_config={"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1, "num_attention_heads": 2,
                      "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32,
                      "audio_token_id": processor.audio_token_id},
    )
    return Phi4MultimodalForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "phi4_multimodal": Builder(
        _phi4_multimodal_processor, _phi4_multimodal_model,
        "Qwen tokenizer + '<|image|>' / '<|audio|>' and ChatML (no official Phi-4-multimodal template is installed; "
        "TRL's phi3 ones are text-only); real Phi4MultimodalImageProcessor (448-px dynamic-HD crops, up to 2) and "
        "Phi4MultimodalProcessor; longrope with distinct short / long factors",
        own_proof=True,
    ),
}
