"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: mRoPE positions from the model's own ``get_rope_index``.

Rules (proven in tests/test_vlm_equivalence.py): causal text attention over the packed row, split at
``cu_seq_lens_q``; the vision tower runs per image (its own ``cu_seqlens``, never ours); positions are
``[4, 1, T]``: row 0 a per-sample arange, rows 1-3 temporal/height/width computed per sample.
``mm_token_type_ids`` (1 on image tokens, 2 on video tokens) is per token. Video is proven for all three
(tests/test_video.py): Qwen2-VL / Qwen2.5-VL write one run of video tokens per video; Qwen3-VL's processor writes
one run per temporal patch, each after its timestamp text (``<0.5 seconds>``), and its ``get_rope_index`` splits
``video_grid_thw`` per frame to match (``video_runs="frame"``). Timestamps are plain text of the user turn.
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Positions, Proof

_PROOF = "tests/test_vlm_equivalence.py"
_TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids")
# Written around every image / video placeholder run; never labelled.
VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>")

QWEN2_VL = register_family(FamilySpec(
    name="qwen2_vl", model_types=("qwen2_vl",),
    proof=Proof(
        _PROOF,
        proven={
            "video": "tests/test_video.py::test_video_packed_equals_each_sample_alone[qwen2_vl]",
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_materialised_length_on_the_shipped_mix",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2_vl-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2_vl-shared]",
            "rl": "tests/test_rl_grpo.py::test_training_steps_equal_trl[qwen2_vl-packed]",
            "rl_shared_prompt": "tests/test_rl_grpo.py::test_training_steps_equal_trl[qwen2_vl-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_token_budget]",
            "context_parallel": "tests/test_vlm_equivalence.py::test_packed_vlm_with_context_parallel_alignment[qwen2_vl]",
        },
    ),
    encoding=EncodingRules(
        token_keys=_TOKEN_KEYS, positions=Positions("mrope", rope_index_model="Qwen2VLModel"),
        media_tokens=VISION_MARKERS,
    ),
))
QWEN2_5_VL = register_family(FamilySpec(
    name="qwen2_5_vl", model_types=("qwen2_5_vl",),
    proof=Proof(
        _PROOF,
        proven={
            "video": "tests/test_video.py::test_video_packed_equals_each_sample_alone[qwen2_5_vl]",
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen2_5_vl]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2_5_vl-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2_5_vl-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[qwen2_5_vl-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[qwen2_5_vl-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_video]",
            "context_parallel": "tests/test_vlm_equivalence.py::test_packed_vlm_with_context_parallel_alignment[qwen2_5_vl]",
        },
    ),
    encoding=EncodingRules(
        token_keys=_TOKEN_KEYS, positions=Positions("mrope", rope_index_model="Qwen2_5_VLModel"),
        media_tokens=VISION_MARKERS,
    ),
))
QWEN3_VL = register_family(FamilySpec(
    name="qwen3_vl", model_types=("qwen3_vl",),
    proof=Proof(
        _PROOF,
        proven={
            "video": "tests/test_video.py::test_video_packed_equals_each_sample_alone[qwen3_vl]",
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen3_vl]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3_vl-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3_vl-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[qwen3_vl-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[qwen3_vl-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_qwen3_vl]",
            "context_parallel": "tests/test_vlm_equivalence.py::test_packed_vlm_with_context_parallel_alignment[qwen3_vl]",
        },
    ),
    encoding=EncodingRules(
        token_keys=_TOKEN_KEYS, positions=Positions("mrope", rope_index_model="Qwen3VLModel"),
        media_tokens=VISION_MARKERS, video_runs="frame",
    ),
))
