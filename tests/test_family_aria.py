"""Aria (Idefics3 tower, query projector, MoE text) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/aria.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["aria"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["aria"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["aria"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


def test_aria_image_splitting_is_refused():
    """Aria with split_image=True: its processor gives every image of a call the call's largest crop count while
    pixel_values hold each image's own crops; the family declares one pixel row per image, so the collator refuses
    the batch by name instead of guessing which crops belong to which sample."""
    from PIL import Image

    setup = families.setup_for("aria")
    processor = families.tiny_vlm_processor("aria")
    processor.images_kwargs = {**processor.images_kwargs, "split_image": True}  # the processor call default
    collator = families.VLMPackingCollator(processor, max_length=4096, model_config=setup.packed.config)
    wide = {"messages": [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (980, 490))},
                                                       {"type": "text", "text": "Wide?"}]},
                         {"role": "assistant", "content": "Yes."}]}
    with pytest.raises(ValueError, match="processor output 'pixel_values' has shape .* one row per image"):
        collator([wide, families.swap_examples()[0]])
