"""Kimi K2.5 (MoonViT-style NaViT tower + DeepSeek-V3 text) and its DeepSeek-V3 language model (``deepseek_v3``, also
on its own: ``DeepseekV3ForCausalLM``): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_kimi_k25.py against each sample alone through the stock sdpa model): the vision
tower runs every image of the call as one patch sequence split by its own ``cu_seqlens`` (from ``image_grid_thw``,
never the text row's: ``enable_packing`` drops the text kwargs at the tower), the 2x2 patch merger and projector act
per image, and ``masked_scatter`` fills ``<|media_pad|>`` in sample order; ``pixel_values`` rows are patches, split
per sample by ``image_grid_thw``. DeepSeek-V3: multi-head latent attention (a value head size other than the
query's, handled by the packed attention), YaRN RoPE (fixed frequencies: the angle depends on the position id
alone), routing per token. ``output_router_logits`` is refused; videos (timestamped chunks) are not proven.
"""

from .registry import register_family, text_backbone
from .spec import STATIC_ROPE_TYPES, FamilySpec, ModelRules, Proof

_PROOF = "tests/test_family_kimi_k25.py"
_YARN = STATIC_ROPE_TYPES | {"yarn"}

DEEPSEEK_V3 = register_family(FamilySpec(
    name="deepseek_v3", model_types=("deepseek_v3",),
    proof=Proof(_PROOF, min_transformers="5.24"),  # proven on 5.24 and 5.25 only (inside Kimi K2.5, round 4)
    model=ModelRules(rope_types=_YARN),
))

# Measured with TRL 1.16 on the tiny model: no reference step to equal.
_NO_TRL_ROLLOUTS = ("TRL 1.16's own GRPOTrainer cannot tokenise a Kimi K2.5 prompt batch (it passes crop_to_patches, "
                    "which Kimi_K25ImageProcessor rejects: TypeError), so packed rollouts have no reference to equal")

KIMI_K25 = register_family(FamilySpec(
    name="kimi_k25", model_types=("kimi_k25",),
    proof=Proof(
        _PROOF,
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[kimi_k25]",
            "context_parallel": f"{_PROOF}::test_edge_batch_equals_each_sample_alone[kimi_k25]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[kimi_k25-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[kimi_k25-shared]",
        },
        refused=dict.fromkeys(("rl", "rl_shared_prompt"), _NO_TRL_ROLLOUTS),
    ),
    # YaRN: DeepSeek-V3's, checked by its own family through text_backbone
    model=ModelRules(rope_types=_YARN, extra_checks=(text_backbone("deepseek_v3"),)),
))
