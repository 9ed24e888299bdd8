"""Nemotron-H Omni (RADIO vision tower + Nemotron-H hybrid text) and its Nemotron-H language model (``nemotron_h``,
also on its own: ``NemotronHForCausalLM``): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_nemotron_h_omni.py against each sample alone through the stock sdpa model):
Nemotron-H's Mamba-2 blocks (``NemotronHMamba2Mixer``) restart their conv window and SSM state at every sample
boundary: ``enable_packing`` gives the model's own mixers vlm_pack's Mamba-2 forward (``vlm_pack.attention.mamba2``,
from the layer's parameters and ``mamba_*`` config fields); its attention blocks are causal inside each sample, its
MLP / MoE blocks act per token. The RADIO tower runs every image of the call as one patch sequence split by its own
``image_grid_hw`` (never the text row's boundaries), the 2x2 pixel shuffle and projector act per image, and
``masked_scatter`` fills ``<image>`` in sample order; ``pixel_values`` rows are patches, four per image token, split
per sample by its image tokens. Refused: audio (the Parakeet tower, not proven) and videos; context parallelism
(a rank would need the SSM state of the chunk before it).
"""

from __future__ import annotations

from typing import Any

from ..attention.linear import CONTEXT_PARALLEL_REFUSAL
from ..attention.packed_layers import install_linear_attention_packing
from .registry import register_family
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows


def _mamba2(model: Any) -> None:
    """Boundary-aware forward on every ``NemotronHMamba2Mixer`` of the model (vlm_pack.attention.packed_layers)."""
    install_linear_attention_packing(model, ("NemotronHMamba2Mixer",))


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """The processor has no ``_get_num_multimodal_tokens``: its image processor's own grid rule
    (``get_patch_grid_size`` under the per-image patch budget of its ``_preprocess``, for one image) written as its
    ``replace_image_token`` does (``<img>``, the image tokens, ``</img>``)."""
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size

    ip = processor.image_processor
    merge = round(1 / ip.downsample_ratio)
    budget = max((ip.max_model_len - 4) * merge**2, ip.min_num_patches)
    budget = max(min(budget, ip.max_num_patches) if ip.max_num_patches else budget, ip.min_num_patches)
    out = []
    for height, width in sizes:
        grid_height, grid_width = get_patch_grid_size(height, width, ip.patch_size, merge, ip.min_num_patches, budget)
        tokens = grid_height * grid_width // merge**2
        out.append((processor.image_start_token + processor.image_token * tokens + processor.image_end_token, tokens))
    return out


# Measured with TRL 1.16 on the tiny model: no reference step to equal.
_NO_TRL_DPO = ("TRL 1.16's own DPOTrainer cannot run a Nemotron-H Omni model (its fused LM-head forward reads "
               "last_hidden_state from the language model, a causal-LM whose output has none: AttributeError), so "
               "packed pairs have no reference to equal")


def _no_audio(config: Any) -> str | None:
    if getattr(config, "audio_config", None) is not None:
        return "an audio tower (audio inputs are not proven; drop audio_config or pass allow_unproven=True)"
    return None


NEMOTRON_H_OMNI = register_family(FamilySpec(
    name="nemotron_h_omni", model_types=("nemotron_h_omni", "nemotron_h"),
    proof=Proof(
        "tests/test_family_nemotron_h_omni.py",
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[nemotron_h_omni]",
        },
        refused={"context_parallel": CONTEXT_PARALLEL_REFUSAL,
                 **dict.fromkeys(("dpo", "dpo_shared_prompt"), _NO_TRL_DPO)},
    ),
    model=ModelRules(layer_kinds=frozenset({"linear_attention", "full_attention", "mlp", "moe"}), prepare_model=_mamba2,
                     extra_checks=(_no_audio,)),
    encoding=EncodingRules(media_tokens=("<img>", "</img>"), mask_before_expansion=True, image_text=_image_text,
                           vision=VisionRows(rows={"pixel_values": "image_token"})),
))
