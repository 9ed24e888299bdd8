"""Qianfan-OCR (InternVL layout: dynamic tiles per image, Qwen3 text): features placed by image-token id, 1-D
positions per sample.

Rules (proven in tests/test_family_qianfan_ocr.py): as InternVL (vlm_pack/models/internvl.py), the vision tower, pixel
shuffle and projector run per tile, ``masked_scatter`` fills ``<IMG_CONTEXT>`` tokens in order; ``pixel_values`` has
one row per tile, split per sample in proportion to its ``<IMG_CONTEXT>`` tokens (``image_seq_length`` per tile).
The language model is a proven text family (Qwen3 in the checkpoints). The processor left-pads a batch by default;
the collator encodes unpadded.
"""

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

QIANFAN_OCR = register_family(FamilySpec(
    name="qianfan_ocr", model_types=("qianfan_ocr",),
    proof=Proof(
        "tests/test_family_qianfan_ocr.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[qianfan_ocr]",
            "context_parallel": "tests/test_family_qianfan_ocr.py::test_edge_batch_equals_each_sample_alone[qianfan_ocr]",
        },
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen3", "qwen2", "llama"),)),
    encoding=EncodingRules(media_tokens=("<img>", "</img>"), vision=VisionRows(rows={"pixel_values": "image_token"})),
))
