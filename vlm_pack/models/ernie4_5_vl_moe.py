"""ERNIE 4.5 VL MoE: 3-D rope positions from the model's own ``Ernie4_5_VLMoeModel.get_rope_index``, per sample,
and mixture-of-experts MLPs with separate text and vision experts.

Rules (proven in tests/test_family_ernie4_5_vl_moe.py): positions are ``[4, 1, T]`` (row 0 a per-sample text arange,
rows 1-3 from ERNIE's own ``get_rope_index`` on each sample alone); ``mm_token_type_ids`` and
``moe_mm_token_type_ids`` (which tokens go to the vision experts: image tokens and their start/end markers) are per
token and packed like ``input_ids``; ``pixel_values`` rows are patches split by ``image_grid_thw``; the vision
tower runs per image on its own ``cu_seqlens`` (never the text kwargs). The router picks experts per token from that
token's hidden state (its expert group chosen by ``moe_mm_token_type_ids``), so a packed row's expert outputs equal
each sample's alone. The processor cannot encode samples of different lengths in one call (``encode_alone``: one
call per sample). Videos (timestamps drawn into the frames) and the router load-balancing loss are not proven
(refused).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Positions, Proof

ERNIE4_5_VL_MOE = register_family(FamilySpec(
    name="ernie4_5_vl_moe", model_types=("ernie4_5_vl_moe",),
    proof=Proof(
        "tests/test_family_ernie4_5_vl_moe.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[ernie4_5_vl_moe]",
            "context_parallel": "tests/test_family_ernie4_5_vl_moe.py::test_edge_batch_equals_each_sample_alone[ernie4_5_vl_moe]",
        },
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids", "moe_mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Ernie4_5_VLMoeModel"),
        media_tokens=("<|IMAGE_START|>", "<|IMAGE_END|>", "<|VIDEO_START|>", "<|VIDEO_END|>"), encode_alone=True,
    ),
))
