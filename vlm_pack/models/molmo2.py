"""Molmo 2 (``molmo2``: a SigLIP-style tower over overlapping crops, an attention-pooling adapter and Molmo 2's own
text model): features ADDED onto the ``<im_patch>`` tokens, 1-D positions per sample.

Rules (proven in tests/test_family_molmo2.py against each sample alone through the stock sdpa model):

* pooling indices per sample: ``image_token_pooling`` has one row per image token, each row the flattened patch
  numbers (``pixel_values`` ``[crops, patches, ...]`` flattened over dims 0 and 1) that token pools, numbered over
  the WHOLE processor call. The collator makes each sample's rows its own and re-bases them by the patches of the
  samples before it in the packed row (``VisionRows.patch_indices``); ``pixel_values`` has one row per crop (the
  low-res view plus the image's overlapping crops, ``image_num_crops`` per image), each image's crops following it
  whole (``tile_tokens``: an image's tokens on its first crop); ``image_grids`` / ``image_num_crops`` one row per
  image;
* one bidirectional block per sample: with ``mm_token_type_ids`` (the model requires them in training) EVERY image
  token of a sequence (patches, column and start / end markers, of all its images) sees every other one
  (``block_sequence_ids = where(mm_token_type_ids == 1, 0, -1)``), not each image (run) its own block:
  ``ImageBlockRule(scope="sample")``, each packed sample its own block id, never one across samples;
* labels: ``Molmo2Processor`` puts its BOS before every prompt that does not start with it, AFTER
  ``apply_chat_template`` has recorded the assistant spans (transformers 5.24), which shifts them by its length;
  the collator has the template write it (``template_prefix``): the stock processor's tokens, labels in place;
* text: causal over the packed row split at ``cu_seq_lens_q``, positions restarting per sample (the stock default
  ``arange``); the scaled and unscaled rotary tables (``rope_scaling_layers``) read the same positions.

Refused: videos (not proven: the video path is left to the registry's ``video`` refusal), context parallelism and
the paths the image blocks rule out (``vlm_pack.models.path_refusal``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .registry import register_family
from .spec import EncodingRules, FamilySpec, ImageBlockRule, ModelRules, Proof, VisionRows

SAMPLE_BLOCKS = ImageBlockRule(token_key="mm_token_type_ids", block_types=(1,), layer_types=frozenset({"full_attention"}),
                               model_class="Molmo2Model", scope="sample")

# What Molmo2Processor writes around and between an image's patches (its image_token_ids, typed 1).
_MARKUP = ("<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>", "<frame_end>",
           "<im_low>")


def _crop_tokens(processor: Any, vision: Mapping[str, torch.Tensor]) -> list[int]:
    """Image tokens per ``pixel_values`` row (crop): each image's tokens (its low-res and high-res pooled grids,
    ``image_grids``) on its first crop, 0 on the others, so a sample takes its images' crops whole."""
    grids, crops = vision["image_grids"], vision["image_num_crops"]
    tokens = (grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).tolist()
    return [count if crop == 0 else 0 for count, n in zip(tokens, crops.tolist()) for crop in range(n)]


def _bos(processor: Any) -> str:
    """What ``Molmo2Processor.__call__`` puts before a text that does not start with it: the tokenizer's BOS, else
    its EOS (after ``apply_chat_template`` recorded the assistant spans, which it would shift)."""
    tokenizer = processor.tokenizer
    return tokenizer.bos_token or tokenizer.eos_token


MOLMO2 = register_family(FamilySpec(
    name="molmo2", model_types=("molmo2",),
    proof=Proof(
        "tests/test_family_molmo2.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                          "[molmo2]"},
    ),
    model=ModelRules(attention="causal_image_blocks", image_blocks=lambda config: SAMPLE_BLOCKS),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"), media_tokens=_MARKUP, template_prefix=_bos,
        vision=VisionRows(
            rows={"pixel_values": "tile", "image_token_pooling": "image_token", "image_grids": "image",
                  "image_num_crops": "image"},
            patch_indices={"image_token_pooling": "pixel_values"}, tile_tokens=_crop_tokens, image_token="<im_patch>",
        ),
    ),
))
