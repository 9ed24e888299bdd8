"""PaddleOCR-VL (NaViT SigLIP vision + ERNIE-4.5 text with 3-D rope): positions from the model's own
``PaddleOCRVLModel.get_rope_index``, per sample.

Rules (proven in tests/test_family_paddleocr_vl.py): like Qwen2-VL, positions are ``[4, 1, T]`` (row 0 a per-sample
text arange, rows 1-3 temporal/height/width from PaddleOCR-VL's own ``get_rope_index`` on each sample alone);
``mm_token_type_ids`` is per token; ``pixel_values`` rows are patches split by ``image_grid_thw``; the vision
tower runs each image on its own ``cu_seqlens`` (built from ``image_grid_thw``, never the text kwargs) and its
features fill the image tokens in sample order. The processor has no video path.
"""

from typing import Any

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Positions, Proof


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``PaddleOCRVLProcessor`` has no ``_get_num_multimodal_tokens``: its image processor's own patch count for
    each size (``get_number_of_image_patches``, the smart resize of its ``__call__``) over its 2x2 merge, written
    as that many image tokens (the processor's ``replace_image_token``)."""
    image_processor = processor.image_processor
    merged = image_processor.merge_size**2
    counts = [image_processor.get_number_of_image_patches(height, width, {}) // merged for height, width in sizes]
    return [(processor.image_token * count, count) for count in counts]

PADDLEOCR_VL = register_family(FamilySpec(
    name="paddleocr_vl", model_types=("paddleocr_vl",),
    proof=Proof(
        "tests/test_family_paddleocr_vl.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[paddleocr_vl]",
            "context_parallel": "tests/test_family_paddleocr_vl.py::test_edge_batch_equals_each_sample_alone[paddleocr_vl]",
        },
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "mm_token_type_ids"),
        positions=Positions("mrope", rope_index_model="PaddleOCRVLModel"),
        media_tokens=("<|IMAGE_START|>", "<|IMAGE_END|>"), image_text=_image_text,
    ),
))
