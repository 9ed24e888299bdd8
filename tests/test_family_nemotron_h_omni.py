"""Nemotron-H Omni (RADIO tower + Nemotron-H Mamba-2 / attention / MLP text) exact under packing (issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/nemotron_h_omni.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["nemotron_h_omni"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["nemotron_h_omni"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["nemotron_h_omni"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_nemotron_h_omni_mamba2_state_carried_across_samples_is_caught(monkeypatch):
    """Nemotron-H's Mamba-2 blocks restart their conv window and SSM state per sample (enable_packing installs
    vlm_pack's Mamba-2 forward on its NemotronHMamba2Mixer modules): the conv window and the selective scan run over
    the whole row (boundaries ignored) are each caught."""
    from vlm_pack.attention import linear as la
    from vlm_pack.attention import mamba2 as m2

    setup = families.setup_for("nemotron_h_omni")
    mixers = [m for m in setup.packed.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    assert mixers and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in mixers)
    examples = families.edge_examples()
    batch, refs = families.exact_batch(setup, examples)
    total = batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)
    conv, scan = m2.packed_causal_conv1d, m2.segmented_selective_scan

    def leaky(hidden_states, weight, bias, activation, cu_seqlens, backend):
        return conv(hidden_states, weight, bias, activation, torch.tensor([0, total]), backend)

    def carried(x, dt, a, b, c, d, layout):
        return scan(x, dt, a, b, c, d, whole_row)

    for name, attr, corrupt in (("conv window", "packed_causal_conv1d", leaky),
                                ("SSM state", "segmented_selective_scan", carried)):
        with monkeypatch.context() as patch:
            patch.setattr(m2, attr, corrupt)
            error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
        print("nemotron_h_omni", name, "carried", error)
        assert refs[3].logits.is_far(error), name
