"""LFM2-VL (SigLIP2 NaFlex tower + LFM2 hybrid text: short-convolution and attention layers) and its LFM2 language
model (``lfm2``, also on its own: ``Lfm2ForCausalLM``): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_lfm2_vl.py): ``full_attention`` layers are causal over the packed row split at
``cu_seq_lens_q``; ``conv`` layers (``Lfm2ShortConv``: a causal depthwise convolution over the last
``conv_L_cache - 1`` tokens) restart their window at every sample boundary: ``enable_packing`` gives the model's
own conv modules vlm_pack's short-conv forward (``vlm_pack.attention.short_conv``, from the layer's parameters; the
exact torch path everywhere, flash-linear-attention's varlen conv on CUDA when installed). The vision tower runs per
tile (its own patch mask, never the text kwargs); ``pixel_values`` / ``pixel_attention_mask`` / ``spatial_shapes``
have one row per tile (large images: crops plus a thumbnail, each its own token count), which the collator gives to
each sample by its image tokens (``tile_tokens``: each tile's ``spatial_shapes`` over the 2x2 pixel unshuffle).
Context parallelism is refused: a rank would need the conv window of the chunk before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_LAYER_KINDS = frozenset({"full_attention", "conv"})
_ROWS = {"pixel_values": "tile", "pixel_attention_mask": "tile", "spatial_shapes": "tile"}


def _short_conv(model: Any) -> None:
    """Boundary-aware forward on every ``Lfm2ShortConv`` of the model (vlm_pack.attention.packed_layers)."""
    install_linear_attention_packing(model, ("Lfm2ShortConv",))


def _tile_tokens(processor: Any, vision: Mapping[str, torch.Tensor]) -> list[int]:
    """Image tokens of each tile: its patch grid (``spatial_shapes``) over the pixel unshuffle, as the model counts."""
    factor = processor.image_processor.downsample_factor
    return (vision["spatial_shapes"] // factor).prod(-1).tolist()


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Lfm2VlProcessor`` has no ``_get_num_multimodal_tokens``: its image processor's own layout rules for each size
    (``_is_image_too_large``, ``smart_resize``, ``_get_grid_layout``, as its ``resize_and_split``) written by the
    processor's own ``replace_image_token``."""
    ip = processor.image_processor
    split = ip.do_image_splitting and not ip.min_tiles == ip.max_tiles == 1
    out = []
    for height, width in sizes:
        large = ip._is_image_too_large(height, width, ip.max_image_tokens, ip.encoder_patch_size, ip.downsample_factor,
                                       ip.max_pixels_tolerance)
        new_width, new_height = ip.smart_resize(height, width, ip.downsample_factor, ip.min_image_tokens,
                                                ip.max_image_tokens, ip.encoder_patch_size)
        cols = rows = 1
        if large and split:
            cols, rows, *_ = ip._get_grid_layout(height, width, ip.min_tiles, ip.max_tiles, ip.tile_size)
        text = processor.replace_image_token(
            {"image_rows": [rows], "image_cols": [cols], "image_sizes": [[new_height, new_width]]}, 0,
            use_image_special_tokens=processor.use_image_special_tokens)
        out.append((text, text.count(processor.image_token)))
    return out


LFM2_VL = register_family(FamilySpec(
    name="lfm2_vl", model_types=("lfm2_vl", "lfm2"),
    proof=Proof(
        "tests/test_family_lfm2_vl.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[lfm2_vl]"},
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(layer_kinds=_LAYER_KINDS, prepare_model=_short_conv),
    encoding=EncodingRules(
        image_text=_image_text,
        media_tokens=("<|image_start|>", "<|image_end|>", "<|img_thumbnail|>") + tuple(
f"<|img_row_{row}_col_{col}|>" for row in range(1, 11) for col in range(1, 11)),
        vision=VisionRows(rows=_ROWS, tile_tokens=_tile_tokens),
    ),
))
