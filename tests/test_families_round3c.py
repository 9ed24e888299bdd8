"""Round-3 families (issue 39, part C) exact under packing: the composite Gemma 3n (timm MobileNetV5 tower), ...

Same proof as tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` + ``VLMPackingCollator``
equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32 CPU): logits and
per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``; the edge batch (system
prompts, a one-word answer, an image inside an assistant turn, text-only and multi-image samples of different
sizes); one corruption per family rule that must break the comparison; token-budget plans equal to the
processor's lengths. Tiny models and offline processors: ``vlm_pack.testing.tiny_families_round3c``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlm_pack.budget import measure_lengths
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family
from vlm_pack.testing.tiny_families_round3c import round3c_processor, round3c_vlm

from test_budget_packs import _GROUPS, _images_example, _materialised_lengths
from test_vlm_families import (
    BOUNDARY_KWARGS, Setup, assert_exact, compare, edge_examples, errors, logit_error, packed_logits, references,
    swap_examples,
)

pytest.importorskip("timm")  # the Gemma 3n, PerceptionLM and FastVLM towers (the package's `test` extra installs it)
pytestmark = pytest.mark.usefixtures("one_thread")


_SETUPS: dict[str, Setup] = {}


def setup_for(family: str) -> Setup:
    if family not in _SETUPS:
        processor = round3c_processor(family)
        stock = round3c_vlm(family, processor)
        packed = enable_packing(round3c_vlm(family, processor))
        collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
        _SETUPS[family] = Setup(family, processor, stock, packed, collator)
    return _SETUPS[family]


FAMILIES = ["gemma3n"]


@pytest.mark.parametrize("family", FAMILIES)
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    setup = setup_for(family)
    result = compare(setup, edge_examples())
    print(family, "edge", result)
    assert_exact(result)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not)."""
    setup = setup_for(family)
    examples = swap_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert_exact(errors(batch, packed_logits(setup.packed, batch), refs))
    samples = setup.collator._encode_all(examples)[0]
    swapped = dict(batch)
    for key in (k for k in samples[0] if k not in setup.collator.token_keys):
        chunks = [sample.get(key) for sample in samples]
        chunks[0], chunks[2] = chunks[2], chunks[0]
        swapped[key] = torch.cat([chunk for chunk in chunks if chunk is not None])
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, swapped), refs))
    no_kwargs = dict.fromkeys(BOUNDARY_KWARGS)  # the stock model reads boundaries from restarting positions
    refs[3].logits.check(logit_error(batch, packed_logits(setup.stock, batch, **no_kwargs), refs))
    whole_row = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["position_ids"])
    not_restarted = packed_logits(setup.stock, batch, **no_kwargs, position_ids=whole_row)
    assert refs[3].logits.is_far(logit_error(batch, not_restarted, refs))


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    setup = setup_for(family)
    examples = [_images_example(group) for group in _GROUPS]
    planned = measure_lengths(examples, setup.collator, progress=False)
    assert planned.tokens.tolist() == _materialised_lengths(setup.collator, examples)
    assert planned.images.tolist() == [len(group) for group in _GROUPS]


# ------------------------------------------------------------------ Gemma 3n (composite)


@torch.no_grad()
def test_gemma3n_sliding_window_and_audio_refusal(monkeypatch):
    """The sliding layers keep their window inside each sample (a dropped window is caught); audio inputs in a
    packed row are refused by name; the composite config with another language model is refused."""
    setup = setup_for("gemma3n")
    examples = edge_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    plain = hf_model.varlen_attention
    monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="Gemma 3n audio inputs"):
        packed_logits(setup.packed, batch, input_features=torch.zeros(1, 8, 128),
                      input_features_mask=torch.ones(1, 8, dtype=torch.bool))
    config = copy.deepcopy(setup.packed.config)  # (timm writes layer factories into the tiny tower's model_args)
    config.text_config.layer_types = ["chunked_attention"] * len(config.text_config.layer_types)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        get_family(config)
