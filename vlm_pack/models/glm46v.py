"""GLM-4.6V: GLM-4V's rules with the 3-D RoPE of its own ``Glm46VModel.get_rope_index``, per sample.

Rules (proven in tests/test_vlm_families.py): as GLM-4V (vlm_pack/models/glm4v.py): ``[4, 1, T]`` positions
computed per sample by the model's own rope index, ``mm_token_type_ids`` per token, the vision tower per image on
its own ``cu_seqlens``, features on the ``<|image|>`` tokens in order. Videos are not proven (refused).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Positions, Proof

GLM46V = register_family(FamilySpec(
    name="glm46v", model_types=("glm46v",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[glm46v]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[glm46v-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[glm46v-shared]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[glm46v]",
        },
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Glm46VModel"),
        media_tokens=("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"),
    ),
))
