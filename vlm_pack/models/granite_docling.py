"""Granite Docling: Idefics3-style page tiles (a global view plus a grid) through a SigLIP-style tower with 2-D
sinusoidal positions, a pixel-shuffle connector and deepstack mergers per tile; Granite text (per-token
multipliers). 1-D positions per sample.

Rules (proven in tests/test_family_granite.py against each sample alone through the stock sdpa model):
``pixel_values`` ``[B, max_tiles, C, H, W]`` and ``pixel_attention_mask`` ``[B, max_tiles]`` have one row PER SAMPLE
(text-only samples included), padded with tiles the mask drops; the tower and connector run per tile, never see
the text, and ``masked_scatter`` fills the ``<image>`` tokens in sample order (the deepstack features too).
Refused: the fine connector route (``use_fine_route=True``, the processor's ``tile_fine_mask``) and the density
router (``density_router_hidden_size``), whose per-page routing and loss are not proven here.
"""

from typing import Any

from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows
from .idefics3 import _MEDIA


def _coarse_only(config: Any) -> str | None:
    if getattr(config.vision_config, "use_fine_route", False):
        return "use_fine_route=True (the fine connector path and its tile_fine_mask are not proven; set it False)"
    if getattr(config, "density_router_hidden_size", None) is not None:
        return "a density router (density_router_hidden_size; its per-page routing and loss are not proven)"
    return None


GRANITE_DOCLING = register_family(FamilySpec(
    name="granite_docling", model_types=("granite_docling",),
    proof=Proof(
        "tests/test_family_granite.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_granite.py::test_planned_length_equals_the_real_processor[granite_docling]"},
    ),
    model=ModelRules(extra_checks=(_coarse_only,)),
    encoding=EncodingRules(
        media_tokens=_MEDIA, vision=VisionRows(rows={"pixel_values": "sample", "pixel_attention_mask": "sample"}),
    ),
))
