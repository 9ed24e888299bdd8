"""Round-3 families (issue 39, part A) exact under packing: Llama 4 (chunked local attention), Mllama (per-sample
cross-attention), Granite 4 Vision, Granite Docling, Phi-4-multimodal (longrope), Gemma 3n's text model.

Same proof as tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` + ``VLMPackingCollator``
equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32 CPU): logits and
per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``; the edge batch (system
prompts, a one-word answer, an image inside an assistant turn, text-only and multi-image samples of different
sizes); one corruption per family rule that must break the comparison; token-budget plans equal to the
processor's lengths. Tiny models and offline processors: ``vlm_pack.testing.tiny_families`` (the builders of
``tiny_families_round3a``).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from vlm_pack.attention.cross import CROSS_KEYS_KWARG as CROSS_KEYS
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

import test_vlm_families as families
from test_budget_packs import assert_planned_lengths_are_the_processors
from test_vlm_families import (
    BOUNDARY_KWARGS, Setup, assert_packed_exact, edge_examples, exact_batch, logit_error, packed_logits, references,
    setup_for, swap_examples,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama4", "granite4_vision", "granite_docling", "mllama", "phi4_multimodal"]


@pytest.mark.parametrize("family", FAMILIES)
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not; not for the harness's
    PACKED_LAYOUT_FAMILIES, Mllama)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


# ------------------------------------------------------------------ Llama 4


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


@torch.no_grad()
@pytest.mark.parametrize("return_dict", [True, False])
def test_llama4_forward_completes_on_every_release(return_dict):
    """transformers 5.24's Llama4ForConditionalGeneration.forward fails on every call (it reads image_outputs from
    its language model's output, which has none); enable_packing adds the field, so the packed forward completes with
    either return_dict and its logits equal the test model's (whose stock reference carries the same field). Caught:
    the field's hook removed, on a release whose forward reads it."""
    setup = setup_for("llama4")
    model = tiny_vlm("llama4", setup.processor)
    model.language_model._forward_hooks.clear()  # the test helper's own field: only vlm_pack's is left
    model = enable_packing(model)
    assert hasattr(model, "_vlm_pack_image_outputs")
    batch = setup.collator(swap_examples())
    inputs = {**families.model_inputs(batch), "use_cache": False, "return_dict": return_dict}
    out = model(**inputs)
    logits = out.logits if return_dict else out[1] if out[0].ndim == 0 else out[0]
    assert torch.equal(logits, setup.packed(**{**inputs, "return_dict": True}).logits)
    model._vlm_pack_image_outputs.remove()
    reads = "image_outputs=outputs.image_outputs" in inspect.getsource(type(model).forward)
    if reads:
        with pytest.raises(AttributeError, match="image_outputs"):
            model(**inputs)
    else:
        model(**inputs)
    print("llama4 forward reads image_outputs from its language model:", reads)


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


# ------------------------------------------------------------------ Granite Docling


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


# ------------------------------------------------------------------ Mllama


@torch.no_grad()
def test_mllama_cross_attention_follows_the_packed_samples(monkeypatch):
    """Cross-attention must keep each sample's text on its own images: all images of the row visible to every
    sample (one key segment), or the processor's mask spans running to the row's end (the processor's rule applied to
    the concatenated text), are caught. The layout hook is what makes the packed batch exact."""
    from vlm_pack.attention.cross import CrossKeys
    from vlm_pack.models import mllama

    setup = setup_for("mllama")
    batch, refs = exact_batch(setup, edge_examples())
    exact = mllama.packed_image_inputs

    def one_segment(kwargs, image_token_id):
        inputs = exact(kwargs, image_token_id)
        counts = inputs[CROSS_KEYS].items_per_segment
        inputs[CROSS_KEYS] = CrossKeys([sum(counts)] + [0] * (len(counts) - 1))
        return inputs

    def row_spans(kwargs, image_token_id):
        total = kwargs["input_ids"].shape[1]
        inputs = exact({**kwargs, "cu_seq_lens_q": torch.tensor([0, total])}, image_token_id)
        return {**inputs, CROSS_KEYS: exact(kwargs, image_token_id)[CROSS_KEYS]}

    for corrupt in (one_segment, row_spans):
        monkeypatch.setattr(mllama, "packed_image_inputs", corrupt)
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))


def test_mllama_refuses_context_parallelism():
    setup = setup_for("mllama")
    with pytest.raises(ValueError, match="cross-attention segments are not split"):
        VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                           context_parallel_size=2)


# ------------------------------------------------------------------ Gemma 3n (text model)


def _text_rows(model, samples, **overrides):
    """Packed logits of ``samples`` (one row, boundaries passed) split per sample."""
    from vlm_pack import pack_batch_sequences

    width = max(len(s) for s in samples)
    padded = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, sample in enumerate(samples):
        padded[row, :len(sample)], mask[row, :len(sample)] = sample, 1
    packed = pack_batch_sequences(padded, padding_mask=mask, pad_to_multiple_of=2)
    inputs = {"input_ids": packed.tokens, "position_ids": packed.position_ids, **packed.attention_kwargs(),
              **overrides}
    logits = model(**inputs, use_cache=False).logits[0]
    return [logits[start:start + len(s)] for start, s in zip(packed.cu_seqlens_padded.tolist(), samples)]


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
    rows = _text_rows(packed_model, samples)
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
        crossing = _text_rows(packed_model, samples, **dict.fromkeys(BOUNDARY_KWARGS), position_ids=whole_row)
        assert logit_floor.is_far(max(max_abs(row, ref) for row, ref in zip(crossing[1:], refs[1:])))
        plain = hf_model.varlen_attention
        monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
        no_window = _text_rows(packed_model, samples)
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


@pytest.mark.parametrize(("config_class", "rule", "wrong"), [
    ("ShieldGemma2Config", "ShieldGemma2ForImageClassification is a classifier", r"reads logits\[:, -1\]"),
])
def test_unproven_round3a_models_are_refused_naming_the_rule(config_class, rule, wrong):
    """ShieldGemma 2 (a last-token classifier) is refused,
    naming why and what allow_unproven=True would get wrong."""
    import transformers

    config = getattr(transformers, config_class)()
    with pytest.raises(UnsupportedModelError, match=rf"model_type '{config.model_type}': {rule}.*{wrong}"):
        get_family(config)


# ------------------------------------------------------------------ Phi-4-multimodal


def _short_chat() -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}


def test_phi4_multimodal_longrope_long_factors_exact_and_mixed_rows_refused():
    """With original_max_position_embeddings=64, image samples (~290 tokens) use longrope's long factors alone: packed
    together they are exact. A row mixing them with a short sample (short factors alone) is refused, naming the bound;
    audio inputs in a packed row are refused by name."""
    processor = tiny_vlm_processor("phi4_multimodal")
    stock = tiny_vlm("phi4_multimodal", processor, original_max_position_embeddings=64)
    packed = enable_packing(tiny_vlm("phi4_multimodal", processor, original_max_position_embeddings=64))
    collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
    setup = Setup("phi4_multimodal", processor, stock, packed, collator)
    examples = [swap_examples()[0], swap_examples()[2]]
    with torch.no_grad():
        batch, refs = exact_batch(setup, examples)
        short = tiny_vlm("phi4_multimodal", processor)  # original 4096: the short factors differ
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(short, batch), refs))
        mixed = collator([examples[0], _short_chat()])
        with pytest.raises(ValueError, match="original_max_position_embeddings=64"):
            packed_logits(packed, mixed)
        with pytest.raises(ValueError, match="audio packing is not proven"):
            packed_logits(packed, batch, audio_input_features=torch.zeros(1, 8, 80))


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
    rows = _text_rows(packed_model, samples)
    floor.check(max(max_abs(row, ref) for row, ref in zip(rows, refs)))
    monkeypatch.setattr(hf_model, "_attention_chunk", lambda module: None)
    unchunked = _text_rows(packed_model, samples)
    assert floor.is_far(max(max_abs(row, ref) for row, ref in zip(unchunked, refs)))
