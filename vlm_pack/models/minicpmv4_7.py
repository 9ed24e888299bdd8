"""MiniCPM-V 4.7: MiniCPM-V 4.6 (NaViT slices, Qwen3.5 hybrid text) positioned by Canvas M-RoPE.

Rules (proven in tests/test_family_minicpmv.py against each sample alone through the stock sdpa model):

* Canvas M-RoPE: 3-D ``[T, H, W]`` positions from each slice's ``target_sizes`` and its ``<image>`` / ``</image>`` /
  ``<slice>`` / ``</slice>`` / newline markers, laid out by the model's own ``get_rope_index`` (the code its
  ``compute_3d_position_ids`` runs). The collator runs it on each sample ALONE (``rope_index_alone``: the sample's own
  tokens, ``mm_token_type_ids`` and slice sizes), so every sample's canvas starts at 0 as it does alone, and puts the
  per-sample text row first (the Qwen3.5 text model reads ``[text, T, H, W]``); a text-only sample gets 1-D
  positions, as the stock model gives it;
* the one-row pixel layout, the slices' ``target_sizes`` rows and the image-id tags are MiniCPM-V 4.6's
  (:mod:`vlm_pack.models.minicpmv4_6`); the Qwen3.5 text model's Gated DeltaNet layers restart per sample.

Refused: a config without the canvas marker ids (the model needs them for any image), videos (not proven), context
parallelism.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from .registry import register_family, text_backbone
from .spec import FamilySpec, Positions, Proof
from .minicpmv4_6 import MINICPMV4_6

_MARKERS = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")


def _canvas_markers(config: Any) -> str | None:
    missing = [name for name in _MARKERS if getattr(config, name, None) is None]
    if missing:
        return (f"no canvas marker ids {missing} in the config (Canvas M-RoPE places images by them; the "
                "checkpoint's config.json stores them)")
    return None


MINICPMV4_7 = register_family(FamilySpec(
    name="minicpmv4_7", model_types=("minicpmv4_7",),
    proof=Proof(
        "tests/test_family_minicpmv.py", min_transformers="5.24",  # the family ships with transformers 5.24
        proven={"budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                          "[minicpmv4_7]"},
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=replace(MINICPMV4_6.model, extra_checks=(text_backbone("qwen3_5_text"), _canvas_markers)),
    # MiniCPM-V 4.6's processor and slices, positioned by Canvas M-RoPE
    encoding=replace(MINICPMV4_6.encoding, token_keys=("input_ids", "labels", "mm_token_type_ids"),
                     positions=Positions("mrope", rope_index_model="MiniCPMV4_7Model", alone=True)),
))
