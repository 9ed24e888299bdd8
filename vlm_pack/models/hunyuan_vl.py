"""HunYuan-VL (HunYuanOCR): multimodal rope positions from the model's own ``HunYuanVLModel.get_rope_index``, on
each sample alone.

Rules (proven in tests/test_family_hunyuan_vl.py): positions are ``[A, 1, T]``, the ``A = len(mrope_section)`` rope
axes (leading axes the 1-D sequence position, the last three width, height and image ordinal) from HunYuan's own
``get_rope_index``, with no text row (``mrope_text_row=False``: its forward recognises one but does not strip it),
so sample boundaries reach the attention as ``cu_seq_lens_*`` only. Its image ordinal counts images across the rows of
a batch, so the collator runs the rope index on each sample alone (``rope_index_alone``: the ordinal restarts per
sample, as for a sample trained alone); ``mm_token_type_ids`` is per token; ``pixel_values`` rows are patches split by ``image_grid_thw``
and the vision tower runs per image. The checkpoints' rope is labelled ``"dynamic"`` with a fixed ``alpha``
(NTK-alpha: static frequencies, which the model computes once); ``"dynamic"`` without ``alpha`` depends on the
sequence length and is refused.
"""

from typing import Any

from .registry import register_family, text_config
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ModelRules, Positions, Proof


def _static_dynamic_rope(config: Any) -> str | None:
    rope = getattr(text_config(config), "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic" and not rope.get("alpha"):
        return ("rope_type 'dynamic' without 'alpha' (its angles depend on the sequence length, which packing "
                "changes; only HunYuan's fixed-alpha NTK rope is static)")
    return None


HUNYUAN_VL = register_family(FamilySpec(
    name="hunyuan_vl", model_types=("hunyuan_vl",),
    proof=Proof(
        "tests/test_family_hunyuan_vl.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[hunyuan_vl]",
            "context_parallel": "tests/test_family_hunyuan_vl.py::test_edge_batch_equals_each_sample_alone[hunyuan_vl]",
        },
    ),
    model=ModelRules(rope_types=STATIC_ROPE_TYPES | {"dynamic"}, extra_checks=(_static_dynamic_rope,)),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="HunYuanVLModel", text_row=False, alone=True),
        media_tokens=("<｜hy_place▁holder▁no▁100｜>", "<｜hy_place▁holder▁no▁101｜>"),
    ),
))
