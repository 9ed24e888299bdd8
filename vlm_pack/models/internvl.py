"""InternVL: dynamic tiles per image, features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): the vision tower runs each tile on its own (a batch of tiles, no
cross-tile attention, no text kwargs: ``get_image_features`` is called without them), pixel shuffle and projector
are per tile, ``masked_scatter`` fills ``<IMG_CONTEXT>`` tokens in order. ``pixel_values`` has one row per TILE
and the processor drops the per-image tile counts, so the collator splits its rows in proportion to each
sample's ``<IMG_CONTEXT>`` tokens (``image_seq_length`` per tile). The language model is a proven text family.
"""

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

INTERNVL = register_family(FamilySpec(
    name="internvl", model_types=("internvl",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[internvl]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[internvl-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[internvl-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[internvl-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[internvl-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_internvl]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[internvl]",
        },
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2", "llama", "qwen3"),)),
    encoding=EncodingRules(media_tokens=("<img>", "</img>"), vision=VisionRows(rows={"pixel_values": "image_token"})),
))
