"""Gemma 4 (vision + text): causal text attention; on sliding layers each image's (and video's) tokens are
bidirectional, inside the window; full-attention layers stay causal.

Rules (proven in tests/test_gemma4.py against each sample alone through the stock sdpa model): with
``use_bidirectional_attention="vision"``, ``Gemma4Model`` builds its sliding masks as ``AND(window, OR(causal,
same block))`` where a block is a run of ``mm_token_type_ids`` in {1 (image), 2 (video)}; full layers are plain
causal. ``mm_token_type_ids`` is per token. Positions restart per sample (1-D); the ``proportional`` RoPE of the
full layers depends on the position only. Key-equals-value full layers, KV-sharing layers and per-layer input
embeddings act per token or per layer and are covered by the proof.

Refused: ``use_bidirectional_attention="all"`` (no causal mask, halved window), mixture-of-experts blocks and
audio towers (not proven); context parallelism (the zigzag split does not carry image-block ids yet).
"""

from __future__ import annotations

from typing import Any

from .registry import register_family, text_config
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ImageBlockRule, ModelRules, Proof

_PROOF = "tests/test_gemma4.py"

IMAGE_BLOCKS = ImageBlockRule(
    token_key="mm_token_type_ids", block_types=(1, 2), layer_types=frozenset({"sliding_attention"}),
    model_class="Gemma4Model",
)


def _image_blocks(config: Any) -> ImageBlockRule | None:
    vision = getattr(config, "vision_config", None) is not None
    return IMAGE_BLOCKS if vision and text_config(config).use_bidirectional_attention == "vision" else None


def _proven_features(config: Any) -> str | None:
    text = text_config(config)
    if text.use_bidirectional_attention == "all":
        return "use_bidirectional_attention='all' (bidirectional text and a halved sliding window)"
    if getattr(text, "enable_moe_block", False):
        return "enable_moe_block=True (mixture-of-experts blocks are not proven)"
    if getattr(config, "audio_config", None) is not None:
        return "an audio tower (audio inputs are not proven; drop audio_config or pass allow_unproven=True)"
    return None


def image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Gemma4Processor`` wraps each image's soft tokens (its own per-size count) in ``<boi>`` / ``<eoi>``."""
    counts = processor._get_num_multimodal_tokens(image_sizes=[list(size) for size in sizes])["num_image_tokens"]
    return [(f"{processor.boi_token}{processor.image_token * int(n)}{processor.eoi_token}", int(n)) for n in counts]


GEMMA4 = register_family(FamilySpec(
    name="gemma4", model_types=("gemma4", "gemma4_text"),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[gemma4]",
        },
    ),
    model=ModelRules(
        attention="causal_image_blocks", image_blocks=_image_blocks,
        layer_kinds=frozenset({"full_attention", "sliding_attention"}), rope_types=STATIC_ROPE_TYPES | {"proportional"},
        extra_checks=(_proven_features,),
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),  # markers: the processor's boi_token / eoi_token
        image_text=image_text,
    ),
))
