"""HunYuan-VL (4-axis rope, image ordinal per sample) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/hunyuan_vl.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["hunyuan_vl"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["hunyuan_vl"])
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", ["hunyuan_vl"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_corruption_hunyuan_image_ordinal_restarts_per_sample():
    """HunYuan-VL's last rope axis is the image ordinal, which its get_rope_index counts across the rows of a batch:
    positions from one rope-index call on the whole padded micro-batch (the family's rope_index_alone off: how the
    stock model positions a padded batch) give later samples' images ordinals their samples alone never see, and
    are caught; so are vision rows given to the wrong sample. (Its forward takes no text row, so the harness's
    position-id boundary check does not apply: boundaries come from cu_seq_lens_* alone.)"""
    import dataclasses

    setup = families.setup_for("hunyuan_vl")
    examples = families.swap_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["position_ids"].shape[0] == 4  # the rope axes only
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    assert refs[3].logits.is_far(families.logit_error(
        batch, families.packed_logits(setup.packed, families.swapped_vision(setup, batch, examples)), refs))

    joint = families.VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config)
    joint.encoding = dataclasses.replace(joint.encoding, positions=dataclasses.replace(joint.encoding.positions, alone=False))  # one call on the padded batch
    counted = joint(examples)["position_ids"]
    assert not torch.equal(counted, batch["position_ids"])
    assert refs[3].logits.is_far(families.logit_error(
        batch, families.packed_logits(setup.packed, batch, position_ids=counted), refs))


def test_hunyuan_length_dependent_rope_is_refused():
    """HunYuan's checkpoints label their fixed-alpha NTK rope "dynamic" (static angles: accepted, proven above); a
    "dynamic" rope without alpha rescales with the sequence length, which packing changes: refused by name."""
    from vlm_pack.models import UnsupportedModelError, get_family

    config = families.setup_for("hunyuan_vl").packed.config
    config = config.__class__.from_dict(config.to_dict())
    assert get_family(config).name == "hunyuan_vl"
    del config.text_config.rope_parameters["alpha"]
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' without 'alpha'"):
        get_family(config)
