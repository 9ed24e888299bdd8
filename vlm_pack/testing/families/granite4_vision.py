"""Tiny Granite 4 Vision (LLaVA-NeXT crops, window Q-Former):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, LLAVA_PINPOINTS, Builder, chatml_template, family_tokenizer, llava_sizes

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Granite 4 Vision (LLaVA-NeXT crops, window Q-Former)

# 28-px crops of 7-px patches (CLIP, CLS dropped: 16 patches), anyres pinpoints up to 2x2 crops; the Q-Former
# downsamples each crop 1/2 (4 tokens per crop). Deepstack: the last vision layer into text layer 0, the first into
# text layer 1; spatial groups into both layers.


def _granite4_vision_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor
    from transformers.models.granite4_vision.processing_granite4_vision import Granite4VisionProcessor

    return Granite4VisionProcessor(
        image_processor=LlavaNextImageProcessor(**llava_sizes(), image_grid_pinpoints=LLAVA_PINPOINTS),
        tokenizer=family_tokenizer(["<image>"]), patch_size=7, vision_feature_select_strategy="default",
        chat_template=chatml_template("<image>"), downsample_rate="1/2", num_additional_image_tokens=1,
    )


def _granite4_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Granite4VisionConfig, Granite4VisionForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Granite4VisionConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": HIDDEN, "intermediate_size": HIDDEN,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 7},
        text_config={"vocab_size": len(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "initializer_range": initializer_range, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                     "attention_multiplier": 0.3, "logits_scaling": 2.0},
        qformer_config={"num_hidden_layers": 1, "intermediate_size": HIDDEN},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=LLAVA_PINPOINTS, downsample_rate="1/2",
        deepstack_layer_map=[[-1, 0], [0, layers - 1]], spatial_target_layers=[0, layers - 1, layers - 1, 0],
        projector_dropout=0.0, initializer_range=initializer_range,
    )
    return Granite4VisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "granite4_vision": Builder(
        _granite4_vision_processor, _granite4_vision_model,
        "Qwen tokenizer + '<image>' and ChatML (no official Granite template is installed); real "
        "LlavaNextImageProcessor (anyres 28-px crops, up to 2x2) and Granite4VisionProcessor; CLIP tower",
        own_proof=True,
    ),
}
