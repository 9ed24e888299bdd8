"""Qwen3.5 (text model and VLM) and Qwen3-Next: hybrid models, Gated DeltaNet and full-attention layers.

Rules (proven in tests/test_linear_attention.py against each sample alone through the stock sdpa model):
``full_attention`` layers are causal over the packed row split at ``cu_seq_lens_q`` (as Qwen-VL);
``linear_attention`` layers restart their causal-conv window and recurrent state at every sample boundary,
through vlm_pack's own DeltaNet forward (``vlm_pack.attention.gated_deltanet``) installed by ``enable_packing`` on
the model's own DeltaNet modules
(flash-linear-attention's varlen kernels on CUDA when installed, an exact torch path elsewhere). The VLM's
positions are ``[4, 1, T]`` from ``Qwen3_5Model.get_rope_index`` per sample; the text models take 1-D positions
per sample (they copy them into their mRoPE rows themselves). Context parallelism is refused: a rank would need
the DeltaNet state of the chunks before it, and that hand-off between ranks is not implemented.
Qwen3-Next is a mixture of experts: with ``output_router_logits`` its load-balancing loss on a packed row is the
padded micro-batch's, alignment slots excluded (``router_loss_mask``, proven in tests/test_router_loss.py).
"""

from __future__ import annotations

from typing import Any

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Positions, Proof

_PROOF = "tests/test_linear_attention.py"
_HYBRID = frozenset({"full_attention", "linear_attention"})


def _deltanet(class_name: str):
    def prepare(model: Any) -> None:
        install_linear_attention_packing(model, (class_name,))

    prepare.__doc__ = f"Boundary-aware forward on every {class_name} of the model (vlm_pack.attention.packed_layers)."
    return prepare


QWEN3_5 = register_family(FamilySpec(
    name="qwen3_5", model_types=("qwen3_5",),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # transformers 5.17: the Gated DeltaNet boundary hooks are not reached
        proven={
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[qwen3_5]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(layer_kinds=_HYBRID, prepare_model=_deltanet("Qwen3_5GatedDeltaNet")),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="Qwen3_5Model"),
        media_tokens=("<|vision_start|>", "<|vision_end|>"),
    ),
))
QWEN3_5_TEXT = register_family(FamilySpec(
    name="qwen3_5_text", model_types=("qwen3_5_text",),
    proof=Proof(
        _PROOF, min_transformers="5.24",
        proven={
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[qwen3_5_text]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(layer_kinds=_HYBRID, prepare_model=_deltanet("Qwen3_5GatedDeltaNet")),
))
QWEN3_NEXT = register_family(FamilySpec(
    name="qwen3_next", model_types=("qwen3_next",),
    proof=Proof(
        _PROOF, min_transformers="5.24",
        proven={
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[qwen3_next]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(layer_kinds=_HYBRID, prepare_model=_deltanet("Qwen3NextGatedDeltaNet"), router_loss_mask=True),
))
