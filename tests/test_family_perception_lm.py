"""PerceptionLM (timm Perception Encoder, tile stacks of different lengths) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/perception_lm.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import assert_packed_exact, edge_examples, exact_batch, logit_error, packed_logits, setup_for
pytest.importorskip("timm")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["perception_lm"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["perception_lm"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["perception_lm"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


@torch.no_grad()
def test_perception_lm_tile_stacks_of_different_lengths_are_flattened_per_tile():
    """The processor cannot batch images whose tile counts differ (its own stack fails); the collator flattens each
    image's tiles to rows (the edge batch holds images of different tile counts): exact, and the tile rows handed
    over in reverse order are caught."""
    from PIL import Image

    setup = setup_for("perception_lm")
    images = [[Image.new("RGB", (64, 32))], [Image.new("RGB", (32, 32))]]
    with pytest.raises(Exception, match="stack expects each tensor to be equal size|equal size"):
        setup.processor(images=images, text=["<|image|> a", "<|image|> b"], return_tensors="pt")
    examples = edge_examples()
    batch, refs = exact_batch(setup, examples)
    tokens = int((batch["input_ids"] == setup.processor.image_token_id).sum())
    assert batch["pixel_values"].shape[1] == 1 and batch["pixel_values"].shape[0] * 4 == tokens
    pictures = [p["image"] for e in examples for m in e["messages"] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image"]
    tiles = [len(setup.processor.image_processor(p, return_tensors=None)["pixel_values"][0]) for p in pictures]
    assert len(set(tiles)) > 1 and sum(tiles) == batch["pixel_values"].shape[0], tiles
    reordered = batch["pixel_values"].flip(0)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch, pixel_values=reordered), refs))
