"""Tiny FastVLM (timm FastViT-MCi + Qwen2):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, qwen2_text

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- FastVLM (timm FastViT-MCi + Qwen2)

# 128-px images (CLIP resize + centre crop), a 5-stage FastViT-MCi of one block per stage (total stride 64): a 2x2
# feature map, 4 <image> tokens per image; BatchNorm layers in the convolutional blocks (eval mode here).
_FAST_VLM_IMAGE = 128


def _fast_vlm_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(size={"shortest_edge": _FAST_VLM_IMAGE},
                                         crop_size={"height": _FAST_VLM_IMAGE, "width": _FAST_VLM_IMAGE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=family_tokenizer(["<image>"]), patch_size=64,
                          vision_feature_select_strategy="full", num_additional_image_tokens=0,
                          chat_template=chatml_template("<image>"))


def _fast_vlm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration

    config = FastVlmConfig(
        vision_config={"model_type": "timm_wrapper", "architecture": "fastvit_mci3", "do_pooling": False,
                       "hidden_size": HIDDEN, "model_args": {"inference_mode": True, "layers": [1] * 5,
                                                              "embed_dims": [8, 16, 16, 32, 32]}},
        text_config=qwen2_text(len(processor.tokenizer), initializer_range, layers),
        image_token_index=processor.image_token_id, image_seq_length=(_FAST_VLM_IMAGE // 64) ** 2,
    )
    model = FastVlmForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # timm's init (layer scales 1e-5) makes the tiny tower's output ~1e-23 for every image
        for parameter in model.model.vision_tower.parameters():
            parameter.normal_(0.0, 0.3)
        for module in model.model.vision_tower.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.normal_(0.0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model


BUILDERS = {
    "fast_vlm": Builder(
        _fast_vlm_processor, _fast_vlm_model,
        "Qwen tokenizer + '<image>' and ChatML (no official FastVLM template is installed); real CLIPImageProcessor "
        "(128 px) and LlavaProcessor (as the FastVLM checkpoints); a one-block-per-stage timm FastViT-MCi",
        own_proof=True,
    ),
}
