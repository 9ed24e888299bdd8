"""The tiny family registry: every family fixture of ``vlm_pack/testing/families/`` (an offline processor and a tiny
random model per family, built as ``vlm_pack.testing.family_parts`` describes), looked up by family name.

A family's fixture module holds its builders in a ``BUILDERS`` dict; this module gathers them. Families proven by
the shared harness (tests/test_vlm_families.py) are :data:`TINY_VLM_FAMILIES`; those whose proof is a test file of
their own (``Builder.own_proof``) are :data:`OWN_PROOF_FAMILIES`.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .families import (
    aria, aya_vision, deepseek_vl, ernie4_5_vl_moe, fast_vlm, gemma3n, gemma4_unified, glm4v, granite4_vision,
    granite_docling, hunyuan_vl, hyperclovax_vision_v2, idefics, internvl, kimi_k25, lfm2_vl, lfm3_vl, lighton_ocr,
    llama4, llava, llava_onevision, minicpmv, mistral3, mllama, molmo2, nemotron_h_omni, ovis2, paddleocr_vl,
    paligemma, perception_lm, phi4_multimodal, qwen2_audio, qwen3_moe, qwen_omni, video_llama_3,
)
from .family_parts import Builder, chatml_template, mistral_text_config

# Re-exported: the text configs and text models some tests build on their own.
from .families.aya_vision import cohere2_text_config
from .families.gemma3n import tiny_gemma3n_text
from .families.llama4 import llama4_text_config

__all__ = ["OWN_PROOF_FAMILIES", "TINY_VLM_FAMILIES", "chatml_template", "cohere2_text_config", "llama4_text_config",
           "mistral_text_config", "tiny_gemma3n_text", "tiny_vlm", "tiny_vlm_processor"]

_MODULES = (llava_onevision, mistral3, internvl, idefics, glm4v, qwen3_moe, llava, aya_vision, deepseek_vl, lighton_ocr,
            paddleocr_vl, ernie4_5_vl_moe, hunyuan_vl, ovis2, qwen_omni, lfm2_vl, aria, minicpmv, molmo2,
            llama4, granite4_vision, granite_docling, mllama, phi4_multimodal, gemma3n, paligemma, fast_vlm,
            perception_lm, video_llama_3, qwen2_audio, gemma4_unified, kimi_k25, lfm3_vl, nemotron_h_omni,
            hyperclovax_vision_v2)
_BUILDERS: dict[str, Builder] = {name: builder for module in _MODULES for name, builder in module.BUILDERS.items()}

TINY_VLM_FAMILIES = tuple(name for name, builder in _BUILDERS.items() if not builder.own_proof)
"""The families proven by the shared harness (tests/test_vlm_families.py) and parametrised over by the trainer,
token-budget and label tests."""
OWN_PROOF_FAMILIES = tuple(name for name, builder in _BUILDERS.items() if builder.own_proof)
"""Built here too, each proven by a test file of its own (tests/test_family_<family>.py, which runs the same
harness): not in TINY_VLM_FAMILIES."""


def tiny_vlm_processor(family: str) -> ProcessorMixin:
    """The offline processor for ``family`` (its fixture module says what is substituted)."""
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


def _builder(family: str) -> Builder:
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny VLM family {family!r}; choose one of {tuple(_BUILDERS)}")
    return _BUILDERS[family]
