"""GLM-4V-MoE (GLM-4.5V): GLM-4V's rules with the 3-D RoPE of its own ``Glm4vMoeModel.get_rope_index`` and
mixture-of-experts MLPs.

Rules (proven in tests/test_vlm_families.py): as GLM-4V (vlm_pack/models/glm4v.py): ``[4, 1, T]`` positions
computed per sample by the model's own rope index, ``mm_token_type_ids`` per token, vision tower per image on its
own ``cu_seqlens``. The router (sigmoid scores with a correction bias, group-limited top-k) picks experts per
token, so expert outputs are those of each sample alone. The load-balancing loss is a mean over the real tokens of
the whole micro-batch: with ``output_router_logits`` a packed row gives the padded micro-batch's value, its
alignment slots excluded (``router_loss_mask``, proven in tests/test_router_loss.py). Videos are not proven
(refused).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Positions, Proof

GLM4V_MOE = register_family(FamilySpec(
    name="glm4v_moe", model_types=("glm4v_moe",),
    proof=Proof(
        "tests/test_vlm_families.py",
        min_transformers="5.24",  # transformers 5.17: its text attention gets 3x the tokens
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[glm4v_moe]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[glm4v_moe-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[glm4v_moe-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[glm4v_moe-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[glm4v_moe-shared]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[glm4v_moe]",
        },
    ),
    model=ModelRules(router_loss_mask=True),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Glm4vMoeModel"),
        media_tokens=("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"),
    ),
))
