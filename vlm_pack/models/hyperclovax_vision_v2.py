"""HyperCLOVA X Vision V2 (a Qwen2.5-VL windowed vision tower + HyperCLOVA X text) and its HyperCLOVA X language
model (``hyperclovax``): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_hyperclovax_vision_v2.py against each sample alone through the stock sdpa model):
the vision tower runs every image of the call as one patch sequence split by its own ``cu_seqlens`` (windows and
images from ``image_grid_thw``, never the text row's), its merger and projector act per image, and
``masked_scatter`` fills ``<|image_pad|>`` in sample order; ``pixel_values`` rows are patches, split per sample by
``image_grid_thw``. The text model (VideoLLaMA 3's layout: 1-D positions, no rope index) is causal inside each
sample; its MuP multipliers act per token or per layer, and the final ``logits * logits_scaling`` is applied in the
chunked loss (``vlm_pack.integrations.head_loss.LOGIT_TRANSFORMS``). Videos (duration text) are not proven.
"""

from __future__ import annotations

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Proof

_PROOF = "tests/test_family_hyperclovax_vision_v2.py"

HYPERCLOVAX_VISION_V2 = register_family(FamilySpec(
    name="hyperclovax_vision_v2", model_types=("hyperclovax_vision_v2", "hyperclovax"),
    proof=Proof(
        _PROOF,
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[hyperclovax_vision_v2]",
            "context_parallel": f"{_PROOF}::test_edge_batch_equals_each_sample_alone[hyperclovax_vision_v2]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[hyperclovax_vision_v2-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[hyperclovax_vision_v2-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[hyperclovax_vision_v2-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[hyperclovax_vision_v2-shared]",
        },
    ),
    encoding=EncodingRules(media_tokens=("<|vision_start|>", "<|vision_end|>")),
))
