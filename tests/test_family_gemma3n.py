"""Gemma 3n: its text model (Gemma3nForCausalLM) and the composite (timm MobileNetV5 tower) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/gemma3n.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import (
    BOUNDARY_KWARGS, assert_packed_exact, edge_examples, logit_error, packed_logits, references, setup_for, text_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gemma3n_text_packed_equals_each_sample_alone(monkeypatch):
    """Logits, plain shifted cross entropy per sample and gradients of their sum vs each sample alone (sliding and
    full layers, KV-shared layers, AltUp, per-layer inputs, activation sparsity); a dropped sliding window and
    attention across samples are caught."""
    import torch.nn.functional as F

    from tolerance import GRAD_REL_L2, NoiseFloor, fp64_copy, grad_errors, max_abs
    from vlm_pack.testing.tiny_families import tiny_gemma3n_text

    stock, packed_model = tiny_gemma3n_text(), enable_packing(tiny_gemma3n_text())
    stock64, logit_floor, loss_floor = fp64_copy(stock), NoiseFloor("logits"), NoiseFloor("per-sample loss")
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 4000, (n,), generator=generator) for n in (7, 12, 5, 9)]
    refs, losses = [], []
    for sample in samples:
        logits = stock(input_ids=sample[None], use_cache=False).logits[0]
        with torch.no_grad():
            logits64 = stock64(input_ids=sample[None], use_cache=False).logits[0]
        logit_floor.observe(logits.detach(), logits64)
        loss_floor.observe(F.cross_entropy(logits[:-1], sample[1:]).detach(),
                           F.cross_entropy(logits64[:-1], sample[1:]))
        refs.append(logits.detach())
        losses.append(F.cross_entropy(logits[:-1], sample[1:]))
    rows = text_rows(packed_model, samples)
    packed_losses = [F.cross_entropy(row[:-1], sample[1:]) for row, sample in zip(rows, samples)]
    logit_floor.check(max(max_abs(row, ref) for row, ref in zip(rows, refs)))
    loss_floor.check(max(max_abs(a, b) for a, b in zip(packed_losses, losses)))
    sum(losses).backward()
    sum(packed_losses).backward()
    wanted = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    got = {name: p.grad for name, p in packed_model.named_parameters() if name in wanted}
    assert max(grad_errors(got, wanted).values()) < GRAD_REL_L2

    with torch.no_grad():
        total = sum(len(s) for s in samples) + sum(len(s) % 2 for s in samples)
        whole_row = torch.arange(total)[None]  # no boundaries and positions that never restart
        crossing = text_rows(packed_model, samples, **dict.fromkeys(BOUNDARY_KWARGS), position_ids=whole_row)
        assert logit_floor.is_far(max(max_abs(row, ref) for row, ref in zip(crossing[1:], refs[1:])))
        plain = hf_model.varlen_attention
        monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
        no_window = text_rows(packed_model, samples)
        assert logit_floor.is_far(max(max_abs(row, ref) for row, ref in zip(no_window, refs)))


def test_gemma3n_text_collator_batch_trains_with_its_own_loss():
    """Chats through the collator (a text tokenizer, ChatML: no official Gemma 3n template is installed; the small
    Qwen vocabulary) into model(**batch), metadata entry included: the model's own loss is the exact per-sample token
    mean of the packed row."""
    from vlm_pack.core.loss import packed_cross_entropy
    from vlm_pack.testing.data import text_chat_examples
    from vlm_pack.testing.tiny_families import tiny_gemma3n_text
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    model = enable_packing(tiny_gemma3n_text(vocab_size=len(tokenizer)))
    batch = VLMPackingCollator(tokenizer, max_length=512, model_config=model.config)(text_chat_examples(4, seed=3))
    with torch.no_grad():
        out = model(**batch)
    expected = packed_cross_entropy(out.logits, batch["labels"], batch["cu_seq_lens_q"])
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["gemma3n"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["gemma3n"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["gemma3n"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


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
