"""LLaVA, LLaVA-NeXT (1.6) and LLaVA-NeXT-Video: features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): the vision tower and projector run per image (LLaVA) or per anyres
crop (NeXT), never see the text kwargs (``get_image_features`` is called without them), and ``masked_scatter``
puts each image's features on its own ``<image>`` tokens in sample order. ``pixel_values`` has one row per image;
for NeXT each row holds the image's crops padded to the batch's largest count, and ``image_sizes`` (one row per
image) tells the model how many are real, so a sample's rows are the same packed or alone. The language model is
a proven text family, causal over the packed row split at ``cu_seq_lens_q``, positions restarting per sample.
LLaVA-NeXT-Video's videos are not proven (refused); its images follow LLaVA-NeXT's rules. VipLLaVA concatenates
several vision layers' features per image before its projector: still per image, same rules as LLaVA. Video-LLaVA's
images (``pixel_values_images``, one row per image) follow LLaVA's rules; its videos are not proven (refused).
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_vlm_families.py"
_TEXT = (text_backbone("llama", "qwen2", "qwen3", "mistral"),)
_NEXT_ROWS = {"pixel_values": "image", "image_sizes": "image"}

LLAVA = register_family(FamilySpec(
    name="llava", model_types=("llava",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[llava]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[llava-packed]",
            "dpo_shared_prompt": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[llava-shared]",
            "rl": "tests/test_rl_families.py::test_step_equals_trl[llava-packed]",
            "rl_shared_prompt": "tests/test_rl_families.py::test_step_equals_trl[llava-shared]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[llava]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT), encoding=EncodingRules(vision=VisionRows(rows={"pixel_values": "image"})),
))
LLAVA_NEXT = register_family(FamilySpec(
    name="llava_next", model_types=("llava_next",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[llava_next]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[llava_next]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT), encoding=EncodingRules(vision=VisionRows(rows=_NEXT_ROWS)),
))
LLAVA_NEXT_VIDEO = register_family(FamilySpec(
    name="llava_next_video", model_types=("llava_next_video",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[llava_next_video]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[llava_next_video]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT), encoding=EncodingRules(vision=VisionRows(rows=_NEXT_ROWS)),
))
VIPLLAVA = register_family(FamilySpec(
    name="vipllava", model_types=("vipllava",),
    proof=Proof(
        _PROOF, min_transformers="5.24",  # transformers 5.17: IndexError in its multi-layer vision feature selection
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[vipllava]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[vipllava]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT), encoding=EncodingRules(vision=VisionRows(rows={"pixel_values": "image"})),
))


def _video_llava_image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Every image is resized and center-cropped to ``crop_size``: the processor's own placeholder string for an
    image of that size (``replace_image_token``; no ``_get_num_multimodal_tokens``). Without the crop the size
    would follow each image's aspect ratio, which is not planned: refused."""
    import numpy as np

    image_processor = processor.image_processor
    if not getattr(image_processor, "do_center_crop", False):
        raise ValueError("token-budget planning for Video-LLaVA needs the image processor's center crop "
                         "(do_center_crop=True, as the checkpoints ship): without it image sizes vary")
    crop = image_processor.crop_size
    text = processor.replace_image_token({"pixel_values_images": [np.zeros((3, crop["height"], crop["width"]))]}, 0)
    return [(text, text.count(processor.image_token))] * len(sizes)


VIDEO_LLAVA = register_family(FamilySpec(
    name="video_llava", model_types=("video_llava",),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[video_llava]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[video_llava]",
        },
    ),
    model=ModelRules(extra_checks=_TEXT),
    encoding=EncodingRules(
        image_text=_video_llava_image_text,
        vision=VisionRows(rows={"pixel_values_images": "image", "pixel_values": "image"}),
    ),
))
