"""LFM3-VL (a NaViT tower of 2-D convolution and attention layers + LFM3 hybrid text) and its LFM3 language model
(``lfm3``, also on its own: ``Lfm3ForCausalLM``): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_lfm3_vl.py against each sample alone through the stock sdpa model): LFM3's
``conv`` layers (``Lfm3ShortConv``: a causal depthwise convolution over the last ``conv_L_cache - 1`` tokens)
restart their window at every sample boundary: ``enable_packing`` gives the model's own conv modules vlm_pack's
short-conv forward (``vlm_pack.attention.short_conv``, from the layer's parameters, as LFM2's);
``sliding_attention`` layers keep their window inside each sample and ``full_attention`` layers (the
``proportional`` RoPE depends on the position alone) are causal inside each sample. The vision tower runs every
image of the call as one patch sequence: its attention layers split by their own ``cu_seqlens`` (from
``image_grid_thw``, never the text row's), its 2-D convolution layers on each image's own patch grid;
``masked_scatter`` fills ``<|image_pad|>`` in sample order. ``pixel_values`` rows are patches, split per sample by
``image_grid_thw``. Refused: videos (timestamped frames, not proven); context parallelism (a rank would need the
conv window of the chunk before it).
"""

from __future__ import annotations

from typing import Any

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ModelRules, Proof


def _short_conv(model: Any) -> None:
    """Boundary-aware forward on every ``Lfm3ShortConv`` of the model (vlm_pack.attention.packed_layers)."""
    install_linear_attention_packing(model, ("Lfm3ShortConv",))


LFM3_VL = register_family(FamilySpec(
    name="lfm3_vl", model_types=("lfm3_vl", "lfm3"),
    proof=Proof(
        "tests/test_family_lfm3_vl.py",
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[lfm3_vl]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[lfm3_vl-packed]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL},
    ),
    model=ModelRules(layer_kinds=frozenset({"conv", "sliding_attention", "full_attention"}),
                     rope_types=STATIC_ROPE_TYPES | {"proportional"}, prepare_model=_short_conv),
    encoding=EncodingRules(media_tokens=("<|vision_start|>", "<|vision_end|>")),
))
