"""Phi-4-multimodal: Phi-3-style causal text; images as dynamic-HD crops (a global view plus up to ``dynamic_hd``
448-px crops) through a SigLIP tower, merged per image with learned separators and placed on ``<|image|>`` tokens.
1-D positions per sample.

Rules (proven in tests/test_family_phi4_multimodal.py against each sample alone through the stock sdpa model):

* ``image_pixel_values`` ``[images, max_crops, ...]``, ``image_attention_mask`` and ``image_sizes`` have one row per
  image (crops padded to the batch's largest count; the model keeps the crops its ``image_sizes`` says are real), the
  tower runs per crop, the merge per image, and ``index_put`` fills the ``<|image|>`` tokens in sample order;
* ``longrope`` (the checkpoints' RoPE) switches to its long factors when a sequence's largest position reaches
  ``original_max_position_embeddings``; positions restart per sample, so a packed row uses the long factors iff its
  longest sample does. Exact when every sample of a row is on the same side; a row mixing both is refused at its
  forward (``enable_packing``'s check), naming the bound.

Refused: audio, by name (the collator refuses audio parts for this family, and audio inputs in a packed row are
refused at the forward: the audio conformer's padding across a batch is not proven).
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import register_family, text_config
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ModelRules, Proof, VisionRows


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Phi4MultimodalProcessor`` has no ``_get_num_multimodal_tokens``: its image processor's own count
    (``num_img_tokens``, from the dynamic-HD crop grid and the padding mask of that size) on a blank image of each
    ``(h, w)``; the placeholder becomes that many ``<|image|>`` tokens."""
    from PIL import Image

    out = []
    for height, width in sizes:
        blank = Image.new("RGB", (width, height))
        count = int(processor.image_processor(blank, return_tensors="pt")["num_img_tokens"][0])
        out.append((processor.image_token * count, count))
    return out


def _row_checks(limit: int | None):
    """Forward pre-hook for a packed row: audio refused; with longrope, samples on both sides of ``limit`` refused."""

    def hook(module, args, kwargs):
        cu, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
        if cu is None:
            return None
        if kwargs.get("audio_input_features") is not None or kwargs.get("audio_embed_sizes") is not None:
            raise ValueError("Phi-4-multimodal audio inputs in a packed row: audio packing is not proven for this "
                             "family (its audio conformer's padding across a batch is not proven); train audio samples "
                             "unpacked")
        if limit is None or positions is None:
            return None
        ends = cu.reshape(-1)[1:] - 1
        longest = positions.reshape(-1)[ends.clamp(min=0)] + 1  # each sample's largest position + 1
        if bool((longest > limit).any()) and bool((longest <= limit).any()):
            raise ValueError(
                f"a packed Phi-4-multimodal row mixes samples longer and not longer than "
                f"original_max_position_embeddings={limit}: longrope would give all of them the long factors, which "
                f"the shorter ones do not get alone. Keep max_length <= {limit}, or pack long samples separately"
            )
        return None

    return hook


def _prepare(model: torch.nn.Module) -> None:
    """Hook every ``Phi4MultimodalModel`` (once) with the packed-row checks."""
    from transformers import Phi4MultimodalModel

    for module in model.modules():
        if isinstance(module, Phi4MultimodalModel) and getattr(module, "_vlm_pack_row_checks", None) is None:
            rope = getattr(module.config, "rope_parameters", None) or {}
            limit = None
            if rope.get("rope_type") == "longrope":
                limit = int(rope.get("original_max_position_embeddings")
                            or text_config(module.config).original_max_position_embeddings)
            module._vlm_pack_row_checks = module.register_forward_pre_hook(_row_checks(limit), with_kwargs=True)


PHI4_MULTIMODAL = register_family(FamilySpec(
    name="phi4_multimodal", model_types=("phi4_multimodal",),
    proof=Proof(
        "tests/test_family_phi4_multimodal.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_phi4_multimodal.py::test_planned_length_equals_the_real_processor[phi4_multimodal]"},
    ),
    model=ModelRules(rope_types=STATIC_ROPE_TYPES | {"longrope"}, prepare_model=_prepare),
    encoding=EncodingRules(
        image_text=_image_text,
        vision=VisionRows(
            rows={"image_pixel_values": "image", "image_sizes": "image", "image_attention_mask": "image"},
        ),
    ),
))
