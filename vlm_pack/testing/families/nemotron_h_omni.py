"""Tiny Nemotron-H Omni (RADIO vision tower, Nemotron-H hybrid text: Mamba-2, attention and MLP blocks):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, chatml_template, family_tokenizer

__all__ = ["BUILDERS", "nemotron_h_text_config"]

# The checkpoints' markup tokens; 7-px patches, 16-64 patches an image (4-16 <image> tokens after the 2x2 shuffle).
_TOKENS = {"image_token": "<image>", "image_start_token": "<img>", "image_end_token": "</img>",
           "video_token": "<video>", "audio_token": "<so_embedding>"}


def _nemotron_h_omni_processor() -> ProcessorMixin:
    from transformers import ParakeetFeatureExtractor
    from transformers.models.nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor, NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
    )

    return NemotronH_Omni_Reasoning_V3Processor(
        image_processor=NemotronH_Omni_Reasoning_V3ImageProcessor(patch_size=7, min_num_patches=16, max_num_patches=64),
        video_processor=NemotronH_Omni_Reasoning_V3VideoProcessor(), tokenizer=family_tokenizer(_TOKENS),
        feature_extractor=ParakeetFeatureExtractor(feature_size=16), chat_template=chatml_template("<image>"),
    )


def nemotron_h_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 3) -> dict:
    """A tiny Nemotron-H language model: a Mamba-2 block (8 heads of 8, 2 groups, state 8, conv window 4), an
    attention block and an MLP block."""
    kinds = ["linear_attention", "full_attention", "mlp"]
    return {
        "model_type": "nemotron_h", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": max(layers, 3), "layers_block_type": (kinds * 2)[:max(layers, 3)],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
        "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4,
        "initializer_range": initializer_range,
    }


def _nemotron_h_omni_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """RADIO tower: one layer, 7-px patches, one class token and one register (dropped before the projector)."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 7,
                       "image_size": 56, "max_img_size": 112, "num_cls_tokens": 1, "num_registers": 1,
                       "video_temporal_patch_size": 2, "initializer_range": initializer_range},
        text_config=nemotron_h_text_config(len(processor.tokenizer), initializer_range, layers), audio_config=None,
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        projector_hidden_size=64, vision_hidden_size=32,
    )
    return NemotronH_Omni_Reasoning_V3._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "nemotron_h_omni": Builder(
        _nemotron_h_omni_processor,
        _nemotron_h_omni_model,
        "Qwen tokenizer + Nemotron-H Omni's markup tokens and ChatML instead of the checkpoint's (no package ships "
        "them); real NemotronH_Omni_Reasoning_V3ImageProcessor (7-px patches, 16-64 an image) and its processor; a "
        "tiny RADIO tower and a tiny Nemotron-H text (Mamba-2, attention, MLP blocks); no audio tower",
    ),
}
