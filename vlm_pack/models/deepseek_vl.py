"""DeepSeek-VL and DeepSeek-VL-Hybrid: features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): the vision tower and aligner run per image (``get_image_features`` is
called without the text kwargs), every image becomes the same ``num_image_tokens`` ``<image_placeholder>`` tokens
(the processor pads each image to a square of the tower's size), and ``masked_scatter`` fills them in sample order.
``pixel_values`` has one row per image. The language model is a proven text family (Llama in the checkpoints),
causal over the packed row split at ``cu_seq_lens_q``, positions restarting per sample. DeepSeek-VL-Hybrid adds a
SAM tower on a high-resolution copy of each image (``high_res_pixel_values``, one row per image; windowed and global
attention inside the image only) whose features join the SigLIP ones per image token: same rules.
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_vlm_families.py"
_TEXT = (text_backbone("llama", "qwen2", "qwen3"),)



def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Every image is padded to the tower's square: the processor's own ``num_image_tokens`` placeholders each
    (``replace_image_token``; the processor has no ``_get_num_multimodal_tokens``)."""
    return [(processor.replace_image_token({}, 0), processor.num_image_tokens) for _ in sizes]


DEEPSEEK_VL = register_family(FamilySpec(
    name="deepseek_vl", model_types=("deepseek_vl",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[deepseek_vl]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[deepseek_vl]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT),
    encoding=EncodingRules(image_text=_image_text, vision=VisionRows(rows={"pixel_values": "image"})),
))
DEEPSEEK_VL_HYBRID = register_family(FamilySpec(
    name="deepseek_vl_hybrid", model_types=("deepseek_vl_hybrid",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[deepseek_vl_hybrid]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[deepseek_vl_hybrid]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT),
    encoding=EncodingRules(
        image_text=_image_text, vision=VisionRows(rows={"pixel_values": "image", "high_res_pixel_values": "image"}),
    ),
))
