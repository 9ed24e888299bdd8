"""Aya Vision and Cohere 2 Vision (Command A Vision; SigLIP tiles + Cohere 2) and their Cohere 2 language model:
features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): like InternVL, the vision tower, pixel shuffle and projector run per
tile (no text kwargs) and ``masked_scatter`` fills the ``<|IMG_PATCH|>`` tokens in order; ``pixel_values`` has one
row per tile and the processor drops the per-image tile counts, so the collator splits its rows in proportion to
each sample's image tokens. Cohere 2 (Command R7B) alternates sliding-window layers (RoPE) with full-attention
layers (no positional encoding): the packed path applies the window inside each sample, causal over the row split
at ``cu_seq_lens_q``, positions restarting per sample.
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_vlm_families.py"
_LAYER_KINDS = frozenset({"full_attention", "sliding_attention"})

# What both processors write around and inside an image (the placeholder expands to patch tokens).
_MEDIA = ("<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")


def _aya_image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """The processor's own image string (``replace_image_token``: "TILE_n" labels as plain text, one global tile,
    start/end markers) for the tile count its image processor gives each size; ``_get_num_multimodal_tokens``
    counts only the patch tokens."""
    out = []
    for height, width in sizes:
        tiles = processor.image_processor.get_number_of_image_patches(height, width, {})
        text = processor.replace_image_token({"num_patches": [tiles]}, 0)
        out.append((text, text.count(processor.img_patch_token)))
    return out


COHERE2 = register_family(FamilySpec(
    name="cohere2", model_types=("cohere2",), proof=Proof(_PROOF), model=ModelRules(layer_kinds=_LAYER_KINDS),
))
AYA_VISION = register_family(FamilySpec(
    name="aya_vision", model_types=("aya_vision",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[aya_vision]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[aya_vision]",
        },
    ),
    model=ModelRules(layer_kinds=_LAYER_KINDS, extra_checks=(text_backbone("cohere2"),)),
    encoding=EncodingRules(
        media_tokens=_MEDIA,
        media_spans=(("<|START_OF_IMG|>", "<|END_OF_IMG|>"),),  # its "TILE_n" tile labels are plain text in between
        image_text=_aya_image_text, expansion_writes_text=True,  # the tile labels
        vision=VisionRows(rows={"pixel_values": "image_token"}),
    ),
))
COHERE2_VISION = register_family(FamilySpec(
    name="cohere2_vision", model_types=("cohere2_vision",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[cohere2_vision]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[cohere2_vision]",
        },
    ),
    model=ModelRules(layer_kinds=_LAYER_KINDS, extra_checks=(text_backbone("cohere2"),)),
    encoding=EncodingRules(media_tokens=_MEDIA, vision=VisionRows(rows={"pixel_values": "image_token"})),
))
