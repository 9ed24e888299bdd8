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

from . import FamilySpec, register_family, text_backbone

_PROOF = "tests/test_vlm_families.py"
_TEXT = (text_backbone("llama", "qwen2", "qwen3", "mistral"),)
_NEXT_ROWS = {"pixel_values": "image", "image_sizes": "image"}

LLAVA = register_family(FamilySpec(
    name="llava", model_types=("llava",), proof=_PROOF, vision_rows={"pixel_values": "image"}, extra_checks=_TEXT,
))
LLAVA_NEXT = register_family(FamilySpec(
    name="llava_next", model_types=("llava_next",), proof=_PROOF, vision_rows=_NEXT_ROWS, extra_checks=_TEXT,
))
LLAVA_NEXT_VIDEO = register_family(FamilySpec(
    name="llava_next_video", model_types=("llava_next_video",), proof=_PROOF, vision_rows=_NEXT_ROWS,
    extra_checks=_TEXT,
))
VIPLLAVA = register_family(FamilySpec(
    name="vipllava", model_types=("vipllava",), proof=_PROOF, vision_rows={"pixel_values": "image"}, extra_checks=_TEXT,
))
VIDEO_LLAVA = register_family(FamilySpec(
    name="video_llava", model_types=("video_llava",), proof=_PROOF,
    vision_rows={"pixel_values_images": "image", "pixel_values": "image"}, extra_checks=_TEXT,
))
