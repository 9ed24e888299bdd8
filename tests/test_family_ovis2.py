"""Ovis 2 (visual vocabulary, tiles, Qwen2 text) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/ovis2.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["ovis2"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["ovis2"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


def test_ovis2_image_tokens_are_its_atoms():
    """Ovis 2's processor replaces its <image> placeholder whole (<IMG_START>, <IMG_ATOM> runs, grid markers,
    <IMG_END>): the family's image_token (<IMG_ATOM>) is what the collator counts, for the statistics and for
    splitting the tile rows of pixel_values per sample (4 atoms per tile here)."""
    from vlm_pack.testing.data import photo_examples

    setup = families.setup_for("ovis2")
    examples = photo_examples(3, seed=2, max_side=84)
    batch = setup.collator(examples)
    atom = setup.processor.tokenizer.convert_tokens_to_ids("<IMG_ATOM>")
    assert not (batch["input_ids"] == setup.processor.image_token_id).any()
    assert batch["vlm_pack"]["stats"].image_tokens == int((batch["input_ids"] == atom).sum()) > 0
    assert batch["pixel_values"].shape[0] * 4 == int((batch["input_ids"] == atom).sum())


@pytest.mark.parametrize("family", ["ovis2"])
def test_unproven_language_model_is_refused(family):
    """Composite families whose language model is a separate registered text family: any other language model, or
    a proven one with an unhandled feature, is refused by name (the harness's check)."""
    families.test_unproven_language_model_is_refused(family)
