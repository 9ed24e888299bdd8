"""Llama-style decoder-only text models (Llama, Qwen2, Qwen3): causal attention, 1-D positions per sample.

Proven in tests/test_families.py (packed row vs each sample alone through the stock sdpa model). Sliding-window
layers (Qwen2/Qwen3 ``use_sliding_window``) are not yet proven, so ``layer_kinds`` refuses them.
"""

from .registry import register_family
from .spec import FamilySpec, Proof

_PROOF = "tests/test_families.py"

LLAMA = register_family(FamilySpec(
    name="llama", model_types=("llama",),
    proof=Proof(
        _PROOF,
        proven={
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[llama-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[llama-shared]",
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[llama]",
            "rl": "tests/test_rl_grpo.py::test_training_steps_equal_trl[llama-packed]",
            "rl_shared_prompt": "tests/test_rl_grpo.py::test_training_steps_equal_trl[llama-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_text]",
            "context_parallel": "tests/test_families.py::test_text_family_with_context_parallel_alignment[llama]",
        },
    ),
))
QWEN2 = register_family(FamilySpec(
    name="qwen2", model_types=("qwen2",),
    proof=Proof(
        _PROOF,
        proven={
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen2-shared]",
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[qwen2]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[qwen2-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[qwen2-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_qwen2]",
            "context_parallel": "tests/test_families.py::test_text_family_with_context_parallel_alignment[qwen2]",
        },
    ),
))
QWEN3 = register_family(FamilySpec(
    name="qwen3", model_types=("qwen3",),
    proof=Proof(
        _PROOF,
        proven={
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[qwen3-shared]",
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[qwen3]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[qwen3-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[qwen3-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_qwen3]",
            "context_parallel": "tests/test_families.py::test_text_family_with_context_parallel_alignment[qwen3]",
        },
    ),
))
