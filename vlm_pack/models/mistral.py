"""Mistral (text) and Mistral3 (Pixtral vision + Mistral text): causal, 1-D positions per sample.

Mistral text layers may use a sliding window (``config.sliding_window``); the packed path applies the same
window inside each sample (proven with a window shorter than the samples). Mistral3: the Pixtral vision tower
runs all images of the batch as ONE sequence with its own block-diagonal mask (per image, built from
``image_sizes``; it never receives the text kwargs), the patch merger and ``masked_scatter`` place each image's
features on its ``[IMG]`` tokens in sample order. ``pixel_values`` (padded to the batch's largest image) and
``image_sizes`` have one row per image. The language model is Mistral or Mistral 4 (vlm_pack/models/mistral4.py).
Proofs: tests/test_vlm_families.py (Mistral text), tests/test_family_mistral4.py (Mistral 4 text).
"""

from .registry import register_family, text_backbone
from .spec import STATIC_ROPE_TYPES, EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_vlm_families.py"

MISTRAL = register_family(FamilySpec(
    name="mistral", model_types=("mistral",),
    proof=Proof(
        _PROOF,
        proven={
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[mistral-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[mistral-shared]",
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[mistral]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[mistral-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[mistral-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_mistral]",
        },
    ),
))
# No reference to prove packed rollouts against (measured with TRL 1.16 on the tiny model).
_NO_TRL_ROLLOUTS = ("TRL 1.16's own GRPOTrainer / RLOOTrainer cannot tokenise a Mistral3 prompt batch "
                    "(PixtralProcessor returns tensors by default, so prompts of different lengths fail: 'Unable to "
                    "create tensor'), so packed rollouts have no reference to equal")
# Measured with TRL 1.16's DPOTrainer (which serves it) and allow_unproven=True: a collation crash, no step.
_NO_PACKED_PAIRS = ("PreferenceCollator encodes each pair on its own, and PixtralProcessor pads pixel_values to the "
                    "largest image of each call, so pairs with images of different sizes cannot be concatenated "
                    "(RuntimeError in torch.cat); use TRL's DPOTrainer")

MISTRAL3 = register_family(FamilySpec(
    name="mistral3", model_types=("mistral3",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[mistral3]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_mistral3]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[mistral3]",
        },
        refused={**dict.fromkeys(("rl", "rl_shared_prompt"), _NO_TRL_ROLLOUTS),
                 **dict.fromkeys(("dpo", "dpo_shared_prompt"), _NO_PACKED_PAIRS)},
    ),
    # YaRN: Mistral 4's (its own check, through text_backbone, refuses it for a Mistral text model)
    model=ModelRules(rope_types=STATIC_ROPE_TYPES | {"yarn"}, extra_checks=(text_backbone("mistral", "mistral4"),)),
    encoding=EncodingRules(
        media_tokens=("[IMG_BREAK]", "[IMG_END]"),
        vision=VisionRows(rows={"pixel_values": "image", "image_sizes": "image"}),
    ),
))
