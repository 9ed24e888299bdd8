"""Ovis 2 (AIMv2-style tower with a visual vocabulary + Qwen2 text): tiles per image, features placed by
image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_ovis2.py): the vision tower, its visual-vocabulary embedding and pixel
shuffle (``hidden_stride``) run per tile (``get_image_features`` is called without the text kwargs), every tile
becomes ``image_seq_length`` ``<IMG_ATOM>`` tokens filled in order by ``masked_scatter``; the five visual
indicator tokens (``<IMG_START>``, ``<IMG_GRID>``, ``<IMG_COL>``, ``<IMG_ROW>``, ``<IMG_END>``) take fixed rows of
the visual embedding table, the same packed or alone. ``pixel_values`` has one row per tile and the processor
drops the per-image grids, so the collator splits its rows in proportion to each sample's ``<IMG_ATOM>`` tokens
(``image_token``: the processor's own image token, ``<image>``, is replaced whole). The
language model is a proven text family.
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Ovis2Processor`` has no ``_get_num_multimodal_tokens``: the tile grid its image processor picks for each
    size (the grid rule of its ``crop_image_to_patches``) written by the processor's own ``replace_image_token``."""
    import torch
    from transformers.models.ovis2 import image_processing_ovis2 as ovis

    image_processor = processor.image_processor
    tile = image_processor.size
    out = []
    for height, width in sizes:
        rows = cols = 1
        if image_processor.crop_to_patches and image_processor.max_patches > 1:
            if image_processor.use_covering_area_grid:
                cols, rows = ovis.get_min_tile_covering_grid((height, width), target_patch_size=tile["height"],
                                                             max_image_tiles=image_processor.max_patches)
            else:
                cols, rows = ovis.get_optimal_tiled_canvas((height, width), (tile["height"], tile["width"]),
                                                           image_processor.min_patches, image_processor.max_patches)
        text = processor.replace_image_token({"grids": torch.tensor([[rows, cols]])}, 0)
        out.append((text, text.count("<IMG_ATOM>")))
    return out


OVIS2 = register_family(FamilySpec(
    name="ovis2", model_types=("ovis2",),
    proof=Proof(
        "tests/test_family_ovis2.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[ovis2]",
            "context_parallel": "tests/test_family_ovis2.py::test_edge_batch_equals_each_sample_alone[ovis2]",
        },
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2", "qwen3", "llama"),)),
    encoding=EncodingRules(
        media_tokens=("<IMG_ATOM>", *_INDICATORS), image_text=_image_text,
        vision=VisionRows(rows={"pixel_values": "image_token"}, image_token="<IMG_ATOM>"),
    ),
))
