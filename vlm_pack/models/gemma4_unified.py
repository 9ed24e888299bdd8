"""Gemma 4 unified (encoder-free: raw pixel patches embedded per patch + Gemma 4 text): causal text attention, and
each image's tokens bidirectional on EVERY layer (sliding and full).

Rules (proven in tests/test_family_gemma4_unified.py against each sample alone through the stock sdpa model): unlike
``Gemma4Model`` (blocks on sliding layers only, inside the window), ``Gemma4UnifiedModel`` hands its
``mm_token_type_ids`` blocks (image 1, video 2) to transformers' ``create_masks_for_generate``, which ORs them into
every layer's mask: full layers ``OR(causal, block)``, sliding layers ``OR(AND(window, causal), block)`` (a block
sees itself whole, past the window). vlm_pack's image blocks are bounded by the window (``AND(window, OR(causal,
block))``); the two agree exactly when no block is longer than the window, so ``enable_packing`` refuses a batch
holding a longer one (by name, in ``Gemma4UnifiedModel``'s forward) and applies the blocks on both layer kinds.
There is no vision tower: ``Gemma4UnifiedVisionEmbedder``
embeds each merged patch on its own (LayerNorm, Dense, a factorised 2-D position embedding from
``image_position_ids``), drops the padding patches and ``masked_scatter`` fills the image tokens in sample order;
``pixel_values`` / ``image_position_ids`` have one row per image. Positions restart per sample (1-D; the full
layers' ``proportional`` RoPE depends on the position only). Its language model on its own
(``gemma4_unified_text``, ``Gemma4UnifiedForCausalLM``) is plain causal text with the same window and softcaps.

Refused: ``use_bidirectional_attention="all"``; audio (raw waveform frames, not proven) and videos; context
parallelism (the zigzag split does not carry image-block ids).
"""

from __future__ import annotations

from typing import Any

import torch

from .gemma4 import image_text
from .registry import register_family, text_config
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ImageBlockRule, ModelRules, Proof

IMAGE_BLOCKS = ImageBlockRule(
    token_key="mm_token_type_ids", block_types=(1, 2), layer_types=frozenset({"sliding_attention", "full_attention"}),
    model_class="Gemma4UnifiedModel",
)


def _longest_block(token_types: torch.Tensor) -> int:
    """Tokens of the longest run of image / video tokens (``IMAGE_BLOCKS.block_types``) in any row."""
    ids = IMAGE_BLOCKS.block_ids(token_types)
    inside = ids[ids >= 0]
    if inside.numel() == 0:
        return 0
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[ids >= 0]
    return int(torch.unique(torch.stack([rows, inside]), dim=1, return_counts=True)[1].max())


def _check_window(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of ``Gemma4UnifiedModel``: refuse an image block longer than the sliding window."""
    token_types = kwargs.get(IMAGE_BLOCKS.token_key)
    window = text_config(module.config).sliding_window
    if token_types is not None and (longest := _longest_block(token_types)) > window:
        raise ValueError(
            f"Gemma 4 unified: an image of {longest} tokens > sliding_window={window}; its sliding layers let the "
            "image see itself past the window, which vlm_pack's image blocks (bounded by the window) do not "
            "reproduce. Give the image processor a smaller max_soft_tokens"
        )


def _prepare(model: torch.nn.Module) -> None:
    """The window check on every ``Gemma4UnifiedModel`` (once)."""
    for module in model.modules():
        if type(module).__name__ == "Gemma4UnifiedModel" and not getattr(module, "_vlm_pack_window_check", False):
            module.register_forward_pre_hook(_check_window, with_kwargs=True)
            module._vlm_pack_window_check = True


def _image_blocks(config: Any) -> ImageBlockRule | None:
    vision = getattr(config, "vision_config", None) is not None
    return IMAGE_BLOCKS if vision and text_config(config).use_bidirectional_attention == "vision" else None


def _proven_features(config: Any) -> str | None:
    if text_config(config).use_bidirectional_attention == "all":
        return "use_bidirectional_attention='all' (bidirectional text and a halved sliding window)"
    if getattr(config, "audio_config", None) is not None:
        return "an audio embedder (audio inputs are not proven; drop audio_config or pass allow_unproven=True)"
    return None


_PROOF = "tests/test_family_gemma4_unified.py"

GEMMA4_UNIFIED = register_family(FamilySpec(
    name="gemma4_unified", model_types=("gemma4_unified", "gemma4_unified_text"),
    proof=Proof(
        _PROOF,
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[gemma4_unified]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[gemma4_unified-packed]",
        },
    ),
    model=ModelRules(
        attention="causal_image_blocks", image_blocks=_image_blocks,
        layer_kinds=frozenset({"full_attention", "sliding_attention"}), rope_types=STATIC_ROPE_TYPES | {"proportional"},
        extra_checks=(_proven_features,), prepare_model=_prepare,
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"), image_text=image_text,
        media_tokens=("<|image>", "<image|>"),
    ),
))
