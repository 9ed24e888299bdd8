"""MiniCPM-V 4.6 (SigLIP-style NaViT tower with a window-attention merger + Qwen3.5 hybrid text): slices per image,
features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_minicpmv.py): the vision tower runs per slice (each slice's own patch grid from
``target_sizes``, never the text kwargs), each slice becomes ``h * w / 16`` image tokens filled in order by
``masked_scatter``. The processor packs every slice of every image of a call into ONE ``pixel_values`` row along
the width (``width_packed``): the collator splits it in proportion to each sample's image tokens (16 patch columns
per token) and joins the samples' shares along the width again; ``target_sizes`` has one row per slice, split by
each slice's tokens (``tile``). The ``<image_id>N</image_id>`` tags number images per sample (the same packed or
alone) and never carry labels. The language model is Qwen3.5's hybrid text model: ``full_attention`` layers causal
over the packed row split at ``cu_seq_lens_q``, ``linear_attention`` (Gated DeltaNet) layers restarting their state
at each sample boundary (``vlm_pack.attention.linear``, as the qwen3_5 family). Context parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_MARKUP = ("<image>", "</image>", "<slice>", "</slice>")


def _deltanet(model: Any) -> None:
    """Boundary-aware forward on every ``Qwen3_5GatedDeltaNet`` of the model (vlm_pack.attention.packed_layers)."""
    install_linear_attention_packing(model, ("Qwen3_5GatedDeltaNet",))


def _divisor(processor: Any) -> int:
    return 4 if processor.image_processor.downsample_mode == "4x" else 16


def _tile_tokens(processor: Any, vision: Mapping[str, torch.Tensor]) -> list[int]:
    """Image tokens of each slice: its patch grid (``target_sizes``) over the 16x (or 4x) merge, as the processor
    counts."""
    return (vision["target_sizes"].prod(-1) // _divisor(processor)).tolist()


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``MiniCPMV4_6Processor`` has no ``_get_num_multimodal_tokens``: its image processor's own layout rules for each
    size (``get_sliced_grid``, ``find_best_resize``, ``get_refine_size``, as its ``_preprocess``) written by the
    processor's own ``replace_image_token``, after the per-sample ``<image_id>`` tag."""
    import numpy as np

    ip = processor.image_processor
    patch, mode = ip.patch_size, ip.downsample_mode
    out = []
    for index, (height, width) in enumerate(sizes):
        grid = ip.get_sliced_grid((height, width), ip.max_slice_nums, ip.scale_resolution) if ip.slice_mode else None
        source = ip.find_best_resize((height, width), ip.scale_resolution, patch, downsample_mode=mode,
                                     allow_upscale=grid is None)
        sizes_ = [[source[0] // patch, source[1] // patch]]
        if grid is not None:
            refine = ip.get_refine_size((height, width), grid, ip.scale_resolution, patch, downsample_mode=mode,
                                        allow_upscale=True)
            sizes_ += [[refine[0] // grid[0] // patch, refine[1] // grid[1] // patch]] * (grid[0] * grid[1])
        text = processor.replace_image_token(
            {"grids": [grid if grid is not None else [0, 0]], "num_patches_per_image": [len(sizes_)],
             "target_sizes": np.array(sizes_)}, 0, image_token_divisor=_divisor(processor))
        if processor.default_use_image_id:
            text = f"{processor.image_id_start_token}{index}{processor.image_id_end_token}" + text
        out.append((text, text.count(processor.image_token)))
    return out


MINICPMV4_6 = register_family(FamilySpec(
    name="minicpmv4_6", model_types=("minicpmv4_6",),
    proof=Proof(
        "tests/test_family_minicpmv.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                          "[minicpmv4_6]"},
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(
        layer_kinds=frozenset({"full_attention", "linear_attention"}), prepare_model=_deltanet,
        extra_checks=(text_backbone("qwen3_5_text"),),
    ),
    encoding=EncodingRules(
        image_text=_image_text, media_tokens=_MARKUP, media_spans=(("<image_id>", "</image_id>"),),
        vision=VisionRows(
            rows={"pixel_values": "image_token", "target_sizes": "tile"}, width_packed=("pixel_values",),
            tile_tokens=_tile_tokens,
        ),
    ),
))
