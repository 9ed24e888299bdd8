"""Qwen3.5-MoE (VLM): Qwen3.5's rules (Gated DeltaNet restarted per sample, mRoPE per sample) with
mixture-of-experts MLPs.

Rules (proven in tests/test_vlm_families.py against each sample alone through the stock sdpa model): as Qwen3.5
(vlm_pack/models/qwen3_5.py) on the MoE model's own classes: ``enable_packing`` installs the boundary-aware
forward of ``vlm_pack.attention.linear`` on every ``Qwen3_5MoeGatedDeltaNet`` (causal-conv window and recurrent
state restart at each sample boundary); ``full_attention`` layers are causal over the packed row split at
``cu_seq_lens_q``; positions are ``[4, 1, T]`` from ``Qwen3_5MoeModel.get_rope_index`` per sample. Experts are
picked per token; with ``output_router_logits`` the load-balancing loss of a packed row is the padded
micro-batch's, its alignment slots excluded (``router_loss_mask``, proven in tests/test_router_loss.py). Refused:
context parallelism (the DeltaNet state would have to pass between ranks).
"""

from __future__ import annotations

from typing import Any

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Positions, Proof

DELTANET_CLASS = "Qwen3_5MoeGatedDeltaNet"


def _restart_deltanet(model: Any) -> None:
    """Boundary-aware forward on every Qwen3_5MoeGatedDeltaNet of the model (vlm_pack.attention.packed_layers)."""
    install_linear_attention_packing(model, (DELTANET_CLASS,))


QWEN3_5_MOE = register_family(FamilySpec(
    name="qwen3_5_moe", model_types=("qwen3_5_moe",),
    proof=Proof(
        "tests/test_vlm_families.py", min_transformers="5.24",  # transformers 5.17: Gated DeltaNet hooks not reached
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qwen3_5_moe]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(
        layer_kinds=frozenset({"full_attention", "linear_attention"}), prepare_model=_restart_deltanet,
        router_loss_mask=True,
    ),
    encoding=EncodingRules(
        positions=Positions("mrope", rope_index_model="Qwen3_5MoeModel"),
        media_tokens=("<|vision_start|>", "<|vision_end|>"), token_keys=("input_ids", "labels", "mm_token_type_ids"),
    ),
))
