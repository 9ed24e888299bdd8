"""Idefics2: a perceiver resampler per image, features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): ``pixel_values`` ``[B, max_images, C, H, W]`` and
``pixel_attention_mask`` have one row PER SAMPLE (text-only samples included), images padded to the batch's
largest and all-zero image slots dropped by the model; the vision tower runs per image with its own patch mask,
the perceiver resamples each image to ``resampler_n_latents`` latents (attending to that image's real patches
only), and ``masked_scatter`` fills the ``<image>`` tokens in sample order. None of them receives the text
kwargs. The language model is a proven text family (Mistral, sliding window inside each sample).
"""

from . import FamilySpec, register_family, text_backbone

IDEFICS2 = register_family(FamilySpec(
    name="idefics2", model_types=("idefics2",), proof="tests/test_vlm_families.py",
    vision_rows={"pixel_values": "sample", "pixel_attention_mask": "sample"}, media_tokens=("<fake_token_around_image>",),
    extra_checks=(text_backbone("mistral", "llama", "qwen2", "qwen3"),),
))
