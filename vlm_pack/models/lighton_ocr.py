"""LightOnOCR (Pixtral vision + Qwen3 text): features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): as Mistral3, the Pixtral vision tower runs all images of the batch
as ONE sequence with its own block-diagonal mask (per image, from ``image_sizes``; it never receives the text
kwargs), the projector's patch merger works image by image and ``masked_scatter`` puts each image's features on
its image tokens in sample order. ``pixel_values`` (padded to the batch's largest image) and ``image_sizes`` have
one row per image. The language model is a proven text family (Qwen3), causal over the packed row split at
``cu_seq_lens_q``, positions restarting per sample.
"""

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

LIGHTON_OCR = register_family(FamilySpec(
    name="lighton_ocr", model_types=("lighton_ocr",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[lighton_ocr]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[lighton_ocr]",
        },
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen3"),)),
    encoding=EncodingRules(
        # Qwen's vision markers (the checkpoint's vocabulary): its processor's break / end tokens and the chat markup.
        media_tokens=("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"),
        vision=VisionRows(rows={"pixel_values": "image", "image_sizes": "image"}),
    ),
))
