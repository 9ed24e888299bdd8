"""GLM-4V (GLM-4.1V): 3-D rope positions from the model's own ``Glm4vModel.get_rope_index``, per sample.

Rules (proven in tests/test_vlm_families.py): like Qwen2-VL, positions are ``[4, 1, T]`` (row 0 a per-sample
text arange, rows 1-3 temporal/height/width computed per sample by ``vlm_pack.core.rope_index.MRopeIndex`` calling
GLM's own ``get_rope_index``); ``mm_token_type_ids`` is per token; ``pixel_values`` rows are patches split by
``image_grid_thw``; the vision tower runs per image on its own ``cu_seqlens`` (never ours: the text kwargs do
not reach it) and its features fill the ``<|image|>`` tokens in order. Videos are not proven (refused).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Positions, Proof

GLM4V = register_family(FamilySpec(
    name="glm4v", model_types=("glm4v",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[glm4v]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[glm4v-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[glm4v-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[glm4v-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[glm4v-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_glm4v]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[glm4v]",
        },
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Glm4vModel"),
        media_tokens=("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"),
    ),
))
