"""Gemma 3n: the composite ``Gemma3nForConditionalGeneration`` (``gemma3n``: timm MobileNetV5 vision tower, audio
conformer, Gemma 3n text) and its text model alone (``Gemma3nForCausalLM``, ``gemma3n_text``): causal attention
with sliding-window and full layers, KV sharing across the last layers, per-layer input embeddings, AltUp, LAuReL
and activation sparsity.

Rules (proven in tests/test_family_gemma3n.py (text and composite) against each
sample alone through the stock sdpa model): attention never crosses a sample and keeps each layer's window inside
it (the composite has no bidirectional image blocks: Gemma 3n's mask is causal over image tokens too); KV-shared
layers reuse the keys and values of an earlier layer of the same forward, so they see the same samples; per-layer
embeddings (looked up from the token ids, media ids mapped to 0), the hard embeddings of ``<end_of_image>`` /
``<end_of_audio>`` (looked up in the vision / audio vocabularies), AltUp predictions / corrections, LAuReL and the
Gaussian top-k activation sparsity all act per token; 1-D positions restart per sample. Images: ``pixel_values``
one row per image (every image resized to one size, a fixed number of soft tokens each), the MobileNetV5 tower
(RMS norms, per-image attention: nothing mixes images) run per image and placed on ``<image_soft_token>`` in sample
order. Final logit softcapping acts on logits only.

Refused: audio, by name: a packed row with ``input_features`` is refused at its forward (the conformer pads every
clip of a batch to the longest and the model pads its output to ``audio_soft_tokens_per_image`` with a learned
embedding; that padding across samples is not proven). Context parallelism is not refused by the family (causal
attention, 1-D positions).
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof


def _refuse_audio(module, args, kwargs):
    """Forward pre-hook of ``Gemma3nModel``: audio inputs in a packed row are refused by name."""
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("input_features") is not None:
        raise ValueError("Gemma 3n audio inputs (input_features) in a packed row: audio packing is not proven for this "
                         "family (its conformer pads every clip of a batch to the longest); train audio samples "
                         "unpacked")


def _prepare(model: torch.nn.Module) -> None:
    """Hook every ``Gemma3nModel`` (once) with the audio refusal."""
    from transformers import Gemma3nModel

    for module in model.modules():
        if isinstance(module, Gemma3nModel) and getattr(module, "_vlm_pack_audio_refusal", None) is None:
            module._vlm_pack_audio_refusal = module.register_forward_pre_hook(_refuse_audio, with_kwargs=True)


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Gemma3nProcessor`` puts ``full_image_sequence`` (``\\n\\n<boi>`` + soft tokens + ``<eoi>\\n\\n``) in place of
    every ``<image_soft_token>`` placeholder, whatever the image size."""
    return [(processor.full_image_sequence, int(processor.image_seq_length))] * len(sizes)


GEMMA3N_TEXT = register_family(FamilySpec(
    name="gemma3n_text", model_types=("gemma3n_text",),
    proof=Proof(
        "tests/test_family_gemma3n.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
    ),
    model=ModelRules(layer_kinds=frozenset({"full_attention", "sliding_attention"})),
))

GEMMA3N = register_family(FamilySpec(
    name="gemma3n", model_types=("gemma3n",),
    proof=Proof(
        "tests/test_family_gemma3n.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_gemma3n.py::test_planned_length_equals_the_real_processor[gemma3n]"},
    ),
    model=ModelRules(
        layer_kinds=frozenset({"full_attention", "sliding_attention"}), extra_checks=(text_backbone("gemma3n_text"),),
        prepare_model=_prepare,
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "token_type_ids"),  # the processor's media types; the model ignores them
        media_tokens=("<start_of_image>", "<image_soft_token>", "<end_of_image>"), image_text=_image_text,
    ),
))
