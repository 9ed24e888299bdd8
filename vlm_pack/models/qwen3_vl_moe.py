"""Qwen3-VL-MoE: Qwen3-VL's rules (interleaved mRoPE from the model's own ``get_rope_index``, per sample) with
mixture-of-experts MLPs.

Rules (proven in tests/test_vlm_families.py): as Qwen3-VL (vlm_pack/models/qwen_vl.py) with
``Qwen3VLMoeModel.get_rope_index``. The router picks experts per token from that token's hidden state, so the
expert outputs of a packed row equal those of each sample alone. The router load-balancing loss is not per token:
it is computed from the expert counts of the WHOLE batch (including any alignment-padding slots of a packed row),
so its value under packing is neither the per-sample one nor a padded batch's; ``output_router_logits`` (which
adds it to the loss) is refused. Videos (timestamps interleaved in the text) are not proven.
"""

from . import FamilySpec, register_family, router_aux_loss_refused

QWEN3_VL_MOE = register_family(FamilySpec(
    name="qwen3_vl_moe", model_types=("qwen3_vl_moe",), proof="tests/test_vlm_families.py",
    positions="mrope", rope_index_model="Qwen3VLMoeModel", token_keys=("input_ids", "labels", "mm_token_type_ids"),
    extra_checks=(router_aux_loss_refused,), media_tokens=("<|vision_start|>", "<|vision_end|>"),
))
