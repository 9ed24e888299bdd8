"""Granite 4 Vision (LLaVA-NeXT crops, window Q-Former) and Granite Docling (Idefics3-style page tiles) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/granite4_vision.py, granite_docling.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest

from vlm_pack.models import UnsupportedModelError, get_family

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import assert_packed_exact, edge_examples, setup_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["granite4_vision", "granite_docling"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["granite4_vision", "granite_docling"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not; not for the harness's
    PACKED_LAYOUT_FAMILIES, Mllama)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["granite4_vision", "granite_docling"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


def test_granite_docling_fine_route_and_density_router_are_refused():
    """Only the coarse connector route is proven: the fine route and the density router are refused by name."""
    config = setup_for("granite_docling").packed.config
    fine = config.__class__.from_dict(config.to_dict())
    fine.vision_config.use_fine_route = True
    with pytest.raises(UnsupportedModelError, match="use_fine_route=True"):
        get_family(fine)
    routed = config.__class__.from_dict(config.to_dict())
    routed.density_router_hidden_size = 8
    with pytest.raises(UnsupportedModelError, match="density router"):
        get_family(routed)
