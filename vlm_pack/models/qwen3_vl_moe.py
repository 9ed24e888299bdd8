"""Qwen3-VL-MoE: Qwen3-VL's rules (interleaved mRoPE from the model's own ``get_rope_index``, per sample) with
mixture-of-experts MLPs.

Rules (proven in tests/test_vlm_families.py, videos in tests/test_video.py): as Qwen3-VL
(vlm_pack/models/qwen_vl.py) with ``Qwen3VLMoeModel.get_rope_index``; videos are written one run of tokens per
frame, each after its timestamp. The router picks experts per token from that token's hidden state, so the
expert outputs of a packed row equal those of each sample alone. The router load-balancing loss is a mean over the
real tokens of the whole micro-batch (``attention_mask`` excludes padding): with ``output_router_logits`` a packed
row gives the padded micro-batch's value, its alignment slots excluded (``router_loss_mask``, proven in
tests/test_router_loss.py).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Positions, Proof

QWEN3_VL_MOE = register_family(FamilySpec(
    name="qwen3_vl_moe", model_types=("qwen3_vl_moe",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "video": "tests/test_video.py::test_video_packed_equals_each_sample_alone[qwen3_vl_moe]",
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen3_vl_moe]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3_vl_moe-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3_vl_moe-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[qwen3_vl_moe-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[qwen3_vl_moe-shared]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[qwen3_vl_moe]",
        },
    ),
    model=ModelRules(router_loss_mask=True),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Qwen3VLMoeModel"),
        media_tokens=("<|vision_start|>", "<|vision_end|>"), video_runs="frame",
    ),
))
