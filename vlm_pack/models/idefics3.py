"""Idefics3 and SmolVLM (same layout and forward): image tiles per sample, features placed by image-token id,
1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): ``pixel_values`` ``[B, max_tiles, C, H, W]`` and
``pixel_attention_mask`` ``[B, max_tiles, H, W]`` have one row PER SAMPLE (text-only samples included), padded
with all-zero tiles that the model drops; the vision tower runs per tile (its own bidirectional mask from
``patch_attention_mask``, never the text kwargs), the connector per tile, and ``masked_scatter`` fills the
``<image>`` tokens in sample order. The language model is a proven text family.
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_ROWS = {"pixel_values": "sample", "pixel_attention_mask": "sample"}
_TEXT = (text_backbone("llama", "qwen2", "qwen3"),)
# What the processor writes around each tile's <image> run (up to the 6x6 tile grid of the real checkpoints).
_MEDIA = ("<fake_token_around_image>", "<global-img>") + tuple(
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)
)

_PROOF = "tests/test_vlm_families.py"

IDEFICS3 = register_family(FamilySpec(
    name="idefics3", model_types=("idefics3",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[idefics3]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[idefics3-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[idefics3-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[idefics3-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[idefics3-shared]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_idefics3]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[idefics3]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT),
    encoding=EncodingRules(
        media_tokens=_MEDIA, expansion_writes_text=True,  # a line break after each row of tiles
        vision=VisionRows(rows=_ROWS),
    ),
))


def _smolvlm_image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``SmolVLMProcessor`` has no ``_get_num_multimodal_tokens``: its own prompt builder on the tile grid its
    image processor gives each size (``get_number_of_image_patches``)."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    out = []
    for height, width in sizes:
        _, rows, cols = processor.image_processor.get_number_of_image_patches(height, width, {})
        text = get_image_prompt_string(rows, cols, processor.image_seq_len, processor.fake_image_token,
                                       processor.image_token, processor.global_image_token)
        out.append((text, processor.image_seq_len * (rows * cols + 1)))
    return out


SMOLVLM = register_family(FamilySpec(
    name="smolvlm", model_types=("smolvlm",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[smolvlm]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[smolvlm]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT),
    encoding=EncodingRules(
        media_tokens=_MEDIA, image_text=_smolvlm_image_text,
        expansion_writes_text=True,  # a line break after each row of tiles
        vision=VisionRows(rows=_ROWS),
    ),
))
