"""Tiny Idefics2 (perceiver resampler), Idefics3 and SmolVLM (image tiles, row breaks):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder, chatml_template, family_tokenizer, mistral_text_config, qwen2_text
from ..tiny_models import TINY_VISION_TOWER, official_template

__all__ = ["BUILDERS"]

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
        tokenizer=family_tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>"]),
        image_seq_len=_IDEFICS2_LATENTS,
        chat_template=chatml_template("<image>"),
    )


def _idefics2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    config = Idefics2Config(
        vision_config={**TINY_VISION_TOWER, "image_size": 56, "patch_size": 7, "initializer_range": initializer_range},
        perceiver_config={"resampler_n_latents": _IDEFICS2_LATENTS, "resampler_depth": 1, "resampler_n_heads": 2,
                          "resampler_head_dim": 16, "num_key_value_heads": 1, "initializer_range": initializer_range,
                          "hidden_size": HIDDEN, "rms_norm_eps": 1e-6},
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
        tokenizer=family_tokenizer(_IDEFICS3_TOKENS),
        image_seq_len=4,
        chat_template=official_template("idefics3"),
    )


def _idefics3_parts(processor, initializer_range: float, layers: int) -> dict:
    """Config arguments shared by Idefics3 and SmolVLM (a Llama language model)."""
    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    return {
        "vision_config": {
            **TINY_VISION_TOWER,
            "image_size": _IDEFICS3_TILE,
            "patch_size": 7,
            "initializer_range": initializer_range,
        },
        "text_config": {**text, "model_type": "llama", "head_dim": HIDDEN // 4},
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
        tokenizer=family_tokenizer(_IDEFICS3_TOKENS),
        image_seq_len=4,
        chat_template=official_template("smolvlm"),
    )


def _smolvlm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    config = SmolVLMConfig(**_idefics3_parts(processor, initializer_range, layers))
    return SmolVLMForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "idefics2": Builder(
        _idefics2_processor,
        _idefics2_model,
        "Qwen tokenizer + '<image>', '<fake_token_around_image>', '<end_of_utterance>' and ChatML instead of the "
        "checkpoint's; real Idefics2ImageProcessor (28-56 px, no splitting) and Idefics2Processor; Mistral text",
    ),
    "idefics3": Builder(
        _idefics3_processor,
        _idefics3_model,
        "Qwen tokenizer + '<image>', '<fake_token_around_image>', '<global-img>', '<row_r_col_c>' tokens and "
        "ChatML instead of the checkpoint's; real Idefics3ImageProcessor (28-px tiles) and Idefics3Processor; "
        "Llama language model",
    ),
    "smolvlm": Builder(
        _smolvlm_processor,
        _smolvlm_model,
        "as idefics3, with SmolVLMImageProcessor / SmolVLMProcessor (needs the PyPI package num2words)",
    ),
}
