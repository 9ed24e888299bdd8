"""Llama 4: causal text with chunked local-attention layers, NoPE layers and top-k MoE; image tiles as ``<|patch|>``
tokens.

Rules (proven in tests/test_family_llama4.py against each sample alone through the stock sdpa model):

* ``chunked_attention`` layers attend causally inside pieces of ``attention_chunk_size`` tokens counted from the
  SAMPLE's start (transformers' chunked mask on a sample alone). The packed attention cuts every sample's
  boundaries at those multiples (``vlm_pack.core.packing.chunk_boundaries``) and runs causal attention over the
  pieces, on every backend; ``full_attention`` layers stay causal per sample;
* positions restart at 0 per sample (1-D RoPE, ``llama3`` scaling accepted); NoPE layers have no positions, but
  their attention-temperature tuning scales queries by ``log1p(floor((i + 1) / floor_scale))`` of the token's
  index ``i`` in the ROW. That factor is 1 for ``i < floor_scale - 1``, so a packed row no longer than
  ``floor_scale - 1`` tokens is exact; a longer one is refused at its forward (``enable_packing``'s check);
* MoE routing is per token (``output_router_logits`` refused: its aux loss is not proven here);
* the vision tower encodes each 336-px tile on its own; ``pixel_values`` has one row per tile and every tile
  (the global view included) becomes ``<|patch|>`` tokens, so the collator splits the rows in proportion to each
  sample's ``<|patch|>`` tokens (``image_token``); the image markup tokens never carry labels.

Note: ``Llama4ForConditionalGeneration.forward`` in transformers 5.24 fails when it returns a dict (it reads
``outputs.image_outputs``, which its language model does not return); ``return_dict=False`` works, and the proof
runs that way. ``Llama4ForCausalLM`` (``llama4_text``) is unaffected.
Refused: context parallelism (the zigzag split does not carry chunk boundaries).
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import register_family, text_config
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_family_llama4.py"
MEDIA_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>")


def _temperature_tuned(config: Any) -> bool:
    """NoPE layers with attention-temperature tuning (a query scale that depends on the row index)."""
    text = text_config(config)
    no_rope = getattr(text, "no_rope_layers", None) or []
    return bool(getattr(text, "attn_temperature_tuning", False)) and not all(no_rope)


def _row_length_hook(limit: int):
    def hook(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids")
        length = (embeds if embeds is not None else ids).shape[1]
        if kwargs.get("cu_seq_lens_q") is not None and length > limit:
            raise ValueError(
                f"a packed Llama 4 row of {length} tokens: its NoPE layers' attention-temperature tuning scales "
                f"queries by the token's index in the row, which equals the sample-alone factor only up to index "
                f"floor_scale - 2, so packed rows must hold at most floor_scale - 1 = {limit} tokens; lower "
                "max_length (or set attn_temperature_tuning=False)"
            )
        return None

    return hook


def _prepare(model: torch.nn.Module) -> None:
    """Hook every ``Llama4TextModel`` with the row-length bound of temperature tuning (once)."""
    from transformers import Llama4TextModel

    for module in model.modules():
        if isinstance(module, Llama4TextModel) and _temperature_tuned(module.config):
            if getattr(module, "_vlm_pack_row_limit", None) is None:
                limit = int(module.config.floor_scale) - 1
                module._vlm_pack_row_limit = module.register_forward_pre_hook(_row_length_hook(limit),
                                                                              with_kwargs=True)


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """The markup ``Llama4Processor`` writes for an image of each ``(h, w)``: its tile grid is the image processor's own
    best fit among the supported resolutions (``find_supported_resolutions`` / ``get_best_fit``), each tile
    ``num_patches_per_chunk`` ``<|patch|>`` tokens, plus a global view when there is more than one tile."""
    from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions, get_best_fit

    images = processor.image_processor
    tile = images.size  # a SizeDict
    resolutions = torch.tensor(find_supported_resolutions(max_num_chunks=images.max_patches, patch_size=tile))
    patches = (tile.height // processor.patch_size) * (tile.width // processor.patch_size)
    per_tile = patches // processor.downsample_ratio
    out = []
    for height, width in sizes:
        target = get_best_fit((height, width), resolutions, resize_to_max_canvas=images.resize_to_max_canvas)
        ratio = (int(target[0]) // tile.height, int(target[1]) // tile.width)
        tiles = ratio[0] * ratio[1] + (1 if ratio[0] * ratio[1] > 1 else 0)
        out.append((processor._prompt_split_image(ratio, per_tile), tiles * per_tile))
    return out


def _chunk_size(config: Any) -> str | None:
    text = text_config(config)
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()) and not text.attention_chunk_size:
        return "chunked_attention layers without an attention_chunk_size"
    return None


LLAMA4 = register_family(FamilySpec(
    name="llama4", model_types=("llama4", "llama4_text"),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_llama4.py::test_planned_length_equals_the_real_processor[llama4]"},
        refused={"context_parallel": "chunked attention is not carried through the context-parallel split (each rank would "
                                     "need the chunk boundaries of its zigzag shards); use context_parallel_size=1"},
    ),
    model=ModelRules(
        layer_kinds=frozenset({"full_attention", "chunked_attention"}), prepare_model=_prepare,
        extra_checks=(_chunk_size,),
    ),
    encoding=EncodingRules(
        media_tokens=MEDIA_TOKENS, image_text=_image_text,
        vision=VisionRows(rows={"pixel_values": "image_token"}, image_token="<|patch|>"),
    ),
))
