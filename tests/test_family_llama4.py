"""Llama 4 (chunked local attention, NoPE layers, MoE) and its text model exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/llama4.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

from test_budget_packs import assert_planned_lengths_are_the_processors
import test_vlm_families as families
from test_vlm_families import (
    assert_packed_exact, edge_examples, exact_batch, logit_error, packed_logits, references, setup_for, swap_examples,
    text_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama4"])
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", ["llama4"])
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not; not for the harness's
    PACKED_LAYOUT_FAMILIES, Mllama)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["llama4"])
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


@torch.no_grad()
def test_llama4_chunks_restart_per_sample(monkeypatch):
    """Chunked layers cut each sample at multiples of attention_chunk_size from ITS start: chunks counted from the
    row's start (the samples' boundaries ignored by the chunk rule), or no chunks at all, are caught."""
    setup = setup_for("llama4")
    batch, refs = exact_batch(setup, edge_examples())
    exact = hf_model.chunk_boundaries

    def row_chunks(cu, chunk):
        cut, _ = exact(torch.tensor([0, int(cu[-1])]), chunk)
        merged = torch.unique(torch.cat([cut.to(cu), cu.to(torch.int32)]))
        return merged, int(merged.diff().max())

    monkeypatch.setattr(hf_model, "chunk_boundaries", row_chunks)
    monkeypatch.setattr(hf_model, "_chunk_cache", None)  # chunks are cached per boundary tensor
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))
    monkeypatch.setattr(hf_model, "chunk_boundaries", lambda cu, chunk: (cu, int(cu.diff().max())))
    monkeypatch.setattr(hf_model, "_chunk_cache", None)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))


@torch.no_grad()
def test_llama4_unpacked_sample_keeps_its_chunks():
    """One sample, unpacked (no boundaries), through the packed model: its chunked layers still chunk."""
    setup = setup_for("llama4")
    example = edge_examples()[3]
    refs = references(setup, [example])
    single = setup.collator([example])
    ids = single["input_ids"]
    assert ids.shape[1] > 2 * setup.packed.config.text_config.attention_chunk_size
    logits = setup.packed(input_ids=ids, pixel_values=single["pixel_values"], use_cache=False).logits[0]
    refs[3].logits.check((logits - refs[0][0]).abs().max().item())


def test_llama4_row_longer_than_the_temperature_floor_is_refused():
    """NoPE layers' temperature tuning scales queries by the row index: exact only in rows of at most
    floor_scale - 1 tokens, so a longer packed row is refused at its forward, naming the bound."""
    processor = tiny_vlm_processor("llama4")
    model = enable_packing(tiny_vlm("llama4", processor, floor_scale=16))
    batch = VLMPackingCollator(processor, max_length=2048, model_config=model.config)(swap_examples())
    with pytest.raises(ValueError, match=r"at most floor_scale - 1 = 15 tokens"):
        model(**batch)


def test_llama4_refusals():
    """Context parallelism (chunk boundaries not split across ranks) and the router aux loss are refused."""
    setup = setup_for("llama4")
    with pytest.raises(ValueError, match="chunked attention is not carried through the context-parallel split"):
        VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                           context_parallel_size=2)
    config = setup.packed.config.__class__.from_dict(setup.packed.config.to_dict())
    config.text_config.output_router_logits = True
    with pytest.raises(UnsupportedModelError, match="output_router_logits"):
        get_family(config)


@torch.no_grad()
def test_llama4_text_model_packed_equals_each_sample_alone(monkeypatch):
    """Llama4ForCausalLM (llama4_text: chunked RoPE layer, NoPE MoE layer) on token samples longer than a chunk:
    packed logits equal each sample alone; dropping the chunk rule is caught."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from tolerance import NoiseFloor, fp64_copy, max_abs
    from vlm_pack.testing.tiny_families import llama4_text_config

    config = Llama4TextConfig(**llama4_text_config(4200))
    torch.manual_seed(0)
    stock = Llama4ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    packed_model = enable_packing(copy.deepcopy(stock))
    stock64, floor = fp64_copy(stock), NoiseFloor("logits")
    generator = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, 4000, (n,), generator=generator) for n in (19, 30, 5, 12)]
    refs = []
    for sample in samples:
        refs.append(stock(input_ids=sample[None], use_cache=False).logits[0])
        floor.observe(refs[-1], stock64(input_ids=sample[None], use_cache=False).logits[0])
    rows = text_rows(packed_model, samples)
    floor.check(max(max_abs(row, ref) for row, ref in zip(rows, refs)))
    monkeypatch.setattr(hf_model, "_attention_chunk", lambda module: None)
    unchunked = text_rows(packed_model, samples)
    assert floor.is_far(max(max_abs(row, ref) for row, ref in zip(unchunked, refs)))
