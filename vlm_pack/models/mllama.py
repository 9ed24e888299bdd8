"""Mllama (Llama 3.2 Vision): causal self-attention text layers plus cross-attention layers from text to the image
tiles' vision states; 1-D positions per sample.

Rules (proven in tests/test_family_mllama.py against each sample alone through the stock sdpa model):

* self-attention layers: causal per sample (split at ``cu_seq_lens_q``), positions restarting at 0;
* cross-attention layers: each sample's tokens attend only to ITS images' vision states (all tiles of each image,
  padded tiles included, as alone), with the processor's own ``cross_attention_mask`` rule inside the sample (a
  token sees the images from the last ``<|image|>`` group before it; tokens before the first image see all of
  the sample's keys uniformly and their MLP branch is zeroed, exactly as the stock model does alone); a sample
  without images gets no cross-attention output and a zeroed MLP branch, as the stock model skipping those layers;
* per packed forward, ``enable_packing``'s hook on ``MllamaModel`` turns the collator's per-sample image rows
  (``pixel_values`` ``[S, max_images, tiles, ...]``, ``aspect_ratio_ids`` / ``aspect_ratio_mask``; padding images
  have aspect-ratio id 0) into one row of the packed row's real images in order, rebuilds
  ``cross_attention_mask`` per sample with the processor's own ``get_cross_attention_token_mask`` (each sample's
  spans end at its own end), and hands each sample's image count to the cross-attention layers
  (``vlm_pack.attention.cross``). The vision tower encodes each image on its own (its tiles attend to each other).

Refused: context parallelism (cross-attention segments are not split across ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention.cross import CROSS_ATTENTION_FLAG, CROSS_KEYS_KWARG, CrossKeys
from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_family_mllama.py"
_ROWS = {"pixel_values": "sample", "aspect_ratio_ids": "sample", "aspect_ratio_mask": "sample"}


def packed_image_inputs(kwargs: dict, image_token_id: int) -> dict:
    """The packed row's image inputs as the stock model takes one sequence: real images in order, and the
    cross-attention mask of every sample by the processor's own rule, plus each segment's image count."""
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    ids, cu = kwargs["input_ids"], kwargs["cu_seq_lens_q"]
    if ids is None or ids.shape[0] != 1:
        raise ValueError("a packed Mllama row needs input_ids of shape [1, T] (its image tokens place the images)")
    bounds = cu.reshape(-1).tolist()
    pixels, ratio_ids = kwargs.get("pixel_values"), kwargs.get("aspect_ratio_ids")
    ratio_mask = kwargs.get("aspect_ratio_mask")
    row = ids[0].tolist()
    spans = [get_cross_attention_token_mask(row[s:e], image_token_id) for s, e in zip(bounds[:-1], bounds[1:])]
    counts = [len(sample) for sample in spans]
    if pixels is None:
        if sum(counts):
            raise ValueError(f"a packed Mllama row with {sum(counts)} image tokens but no pixel_values")
        return {"cross_attention_mask": None}
    real = ratio_ids.reshape(-1) > 0
    if int(real.sum()) != sum(counts):
        raise ValueError(f"a packed Mllama row with {sum(counts)} image tokens but {int(real.sum())} images")
    ratio_mask = ratio_mask.reshape(-1, ratio_mask.shape[-1])[real]
    tiles = ratio_mask.sum(-1).tolist()
    mask = torch.zeros(1, len(row), len(tiles), ratio_mask.shape[-1], dtype=torch.long, device=ids.device)
    image = 0
    for start, end, sample in zip(bounds[:-1], bounds[1:], spans):
        for first, last in sample:
            last = end - start if last == -1 else last
            mask[0, start + first:start + last, image, :tiles[image]] = 1
            image += 1
    return {
        "pixel_values": pixels.reshape(-1, *pixels.shape[2:])[real].unsqueeze(0),
        "aspect_ratio_ids": ratio_ids.reshape(-1)[real].unsqueeze(0),
        "aspect_ratio_mask": ratio_mask.unsqueeze(0),
        "cross_attention_mask": mask,
        CROSS_KEYS_KWARG: CrossKeys(counts),
    }


def _packed_row_hook(image_token_id: int):
    def hook(module, args, kwargs):
        if kwargs.get("cu_seq_lens_q") is None:
            return None
        if args:
            raise ValueError("call the packed Mllama model with keyword arguments (model(**batch))")
        return args, {**kwargs, **packed_image_inputs(kwargs, image_token_id)}

    return hook


def _prepare(model: torch.nn.Module) -> None:
    """Hook every ``MllamaModel`` (packed image layout per forward) and mark its cross-attention layers (once)."""
    from transformers import MllamaModel
    from transformers.models.mllama.modeling_mllama import MllamaTextCrossAttention

    hooked = 0
    for module in model.modules():
        if isinstance(module, MllamaTextCrossAttention):
            setattr(module, CROSS_ATTENTION_FLAG, True)
        if isinstance(module, MllamaModel):
            hooked += 1
            if getattr(module, "_vlm_pack_mllama_hook", None) is None:
                module._vlm_pack_mllama_hook = module.register_forward_pre_hook(
                    _packed_row_hook(module.config.image_token_id), with_kwargs=True)
    if hooked == 0:
        raise ValueError(f"{type(model).__name__} holds no MllamaModel: call enable_packing on the full model "
                         "(MllamaForConditionalGeneration)")


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Mllama writes no tokens per tile: every image stays one ``<|image|>`` token (cross-attention carries it)."""
    return [(processor.image_token, 1)] * len(sizes)


MLLAMA = register_family(FamilySpec(
    name="mllama", model_types=("mllama",),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_mllama.py::test_planned_length_equals_the_real_processor[mllama]"},
        refused={"context_parallel": "cross-attention segments are not split across context-parallel ranks; use "
                                     "context_parallel_size=1"},
    ),
    model=ModelRules(prepare_model=_prepare),
    encoding=EncodingRules(image_text=_image_text, vision=VisionRows(rows=_ROWS)),
))
