"""VideoLLaMA 3 (NaViT SigLIP tower + Qwen2 text): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_video_llama_3.py against each sample alone through the stock sdpa model): the vision
tower runs every image of the call as one patch sequence split by its own ``cu_seqlens`` (from ``image_grid_thw``,
never the text row's: ``enable_packing`` drops the text kwargs at the tower), its pixel unshuffle and projector act
per image, and ``masked_scatter`` fills the ``<|image_pad|>`` tokens in sample order. ``pixel_values`` rows are
patches, split per sample by ``image_grid_thw``; ``image_grid_thw`` and ``image_merge_sizes`` have one row per image.
The language model is a proven text family (Qwen2 in the checkpoints). Videos (frame-difference token compression,
``video_compression_mask``) are not proven: the collator refuses them.
"""

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_family_video_llama_3.py"

# Measured with TRL 1.16 on the tiny model: no reference step to equal.
_NO_TRL_ROLLOUTS = ("TRL 1.16's own GRPOTrainer cannot score a VideoLLaMA 3 rollout (it hands the processor's "
                    "image_merge_sizes to _get_per_token_logps_and_entropies: TypeError), so packed rollouts have no "
                    "reference to equal")

VIDEO_LLAMA_3 = register_family(FamilySpec(
    name="video_llama_3", model_types=("video_llama_3",),
    proof=Proof(
        _PROOF,
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family"
                      "[video_llama_3]",
            "context_parallel": f"{_PROOF}::test_edge_batch_equals_each_sample_alone[video_llama_3]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[video_llama_3-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[video_llama_3-shared]",
        },
        refused=dict.fromkeys(("rl", "rl_shared_prompt"), _NO_TRL_ROLLOUTS),
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2"),)),
    encoding=EncodingRules(vision=VisionRows(rows={"image_merge_sizes": "image"})),
))
