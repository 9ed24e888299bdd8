"""PaliGemma (prefix-LM) and PaliGemma 2 (a Gemma 2 language model: softcapping, sliding windows) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

PaliGemma 2's reference is the stock EAGER model: transformers refuses to build Gemma 2 under sdpa (SDPA has no
softcapping; ``test_paligemma2_reference_is_eager``), and eager is what applies every Gemma 2 rule. Its rules: the
attention-logit softcapping inside every attention backend the packed attention routes to (CPU exact path, flex, the
flash-attn fake; torch varlen and TransformerEngine refuse it by name), the sliding window counted from each sample's
start, the prefix block per sample in the sliding layers too, and the final logit softcapping in the chunked loss.

Tiny models and offline processors: ``vlm_pack/testing/families/paligemma.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.attention import varlen as attention
from vlm_pack.attention.varlen import available_backends, dense_attention, select_backend, varlen_attention
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

from test_attention import FakeKernels, cu_of, fake_machine, random_qkv, reference
from test_budget_packs import _GROUPS, assert_planned_lengths_are_the_processors
from test_vlm_families import (
    Setup, assert_exact, assert_packed_exact, compare, errors, exact_batch, logit_error, packed_logits, references,
    setup_for,
)
from version_gates import refused, require_proven

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


def _paligemma_examples(seed: int = 3) -> list[dict]:
    """Single-turn photo Q&A (PaliGemma's format): 1-3 images of different sizes per sample."""
    from vlm_pack.testing.data import photo_examples

    return photo_examples(4, seed=seed, max_side=56)


def test_paligemma_packed_equals_each_sample_alone():
    """Logits, per-sample losses (the processor's own suffix labels), the model's own loss and gradients of a
    packed micro-batch vs each sample alone through the stock model (its own prefix-LM mask and 1-indexed
    positions); multi-image samples of different sizes."""
    setup = setup_for("paligemma")
    examples = _paligemma_examples()
    assert max(sum(p["type"] == "image" for p in e["messages"][0]["content"]) for e in examples) > 1
    assert_packed_exact(setup, examples, "photos")


@torch.no_grad()
def test_paligemma_prefix_block_and_causal_answer_are_each_needed(monkeypatch):
    """The prefix-LM rule has two halves, each caught: the text layers left non-causal (as PaliGemmaConfig sets
    them: the answer would attend both ways) and the prefix made causal (no prefix block)."""
    from vlm_pack.models import paligemma

    setup = setup_for("paligemma")
    batch, refs = exact_batch(setup, _paligemma_examples())
    no_prefix = packed_logits(setup.packed, batch, token_type_ids=torch.ones_like(batch["token_type_ids"]))
    assert refs[3].logits.is_far(logit_error(batch, no_prefix, refs))
    layers = [m for m in setup.packed.model.language_model.modules() if hasattr(m, "is_causal")
              and hasattr(m, "q_proj")]
    assert layers and all(layer.is_causal for layer in layers)
    for layer in layers:
        monkeypatch.setattr(layer, "is_causal", False)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))
    assert paligemma.PREFIX_BLOCKS.block_types == (0,)


def test_paligemma_planned_length_equals_the_real_processor():
    """Token-budget plans count what the processor's prompt / suffix encoding writes, for images of many sizes and
    several per sample."""
    planned = assert_planned_lengths_are_the_processors(setup_for("paligemma").collator)
    assert planned.image_tokens.tolist() == [4 * len(group) for group in _GROUPS]


def test_paligemma_refusals():
    """A language model other than Gemma / Gemma 2 (PaliGemma 2: below) is refused by name;
    so are samples PaliGemma's single-turn format cannot hold (a system turn, two turns, no image, an image in the
    answer) and a chat template."""
    from transformers import PaliGemmaConfig

    from vlm_pack.testing.data import text_chat_examples

    with refused(UnsupportedModelError, r"language model 'gemma3_text' \(proven language models for ",
                 family="paligemma"):
        get_family(PaliGemmaConfig(text_config={"model_type": "gemma3_text"}))
    setup = setup_for("paligemma")
    photo = _paligemma_examples()[0]
    system = {"messages": [{"role": "system", "content": "Be brief."}, *photo["messages"]]}
    twice = {"messages": photo["messages"] * 2}
    in_answer = {"messages": [photo["messages"][0], {"role": "assistant", "content": photo["messages"][0]["content"]}]}
    for example, message in ((system, r"sample 0: PaliGemma is a single-turn prefix-LM.*\['system', 'user'"),
                             (twice, r"single-turn.*\['user', 'assistant', 'user', 'assistant'\]"),
                             (text_chat_examples(1, seed=1, max_turns=1)[0], "at least one image"),
                             (in_answer, "images in the user turn only")):
        with pytest.raises(ValueError, match=message):
            setup.collator([example])
    with pytest.raises(ValueError, match="not by a chat template"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, chat_template="{{ x }}")
    with pytest.raises(ValueError, match="prefix blocks|image blocks"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, context_parallel_size=2)


_SETUPS: dict[str, Setup] = {}


def paligemma2() -> Setup:
    require_proven("paligemma")
    if "paligemma2" not in _SETUPS:
        processor = tiny_vlm_processor("paligemma2")
        stock = tiny_vlm("paligemma2", processor, attn_implementation="eager")
        packed = enable_packing(tiny_vlm("paligemma2", processor, attn_implementation="eager"))
        collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
        _SETUPS["paligemma2"] = Setup("paligemma2", processor, stock, packed, collator)
    return _SETUPS["paligemma2"]


def test_paligemma2_reference_is_eager():
    """transformers builds Gemma 2 under eager only (its sdpa path would drop the softcapping): the reference."""
    require_proven("paligemma")
    processor = tiny_vlm_processor("paligemma2")
    with pytest.raises(ValueError, match="Gemma2Model does not support an attention implementation through"):
        tiny_vlm("paligemma2", processor, attn_implementation="sdpa")
    text = paligemma2().stock.config.text_config
    assert text.model_type == "gemma2" and text.attn_logit_softcapping and text.final_logit_softcapping
    assert text.layer_types == ["sliding_attention", "full_attention"]
    assert text.query_pre_attn_scalar != text.head_dim


def test_paligemma2_packed_equals_each_sample_alone():
    """Logits, per-sample losses, the model's own (chunked, final-softcapped) loss and gradients of a packed
    micro-batch vs each sample alone through the stock eager model; multi-image samples of different sizes, one
    running past the sliding window after its prefix."""
    setup = paligemma2()
    examples = _paligemma_examples()
    lengths = [s["input_ids"].shape[1] for s in setup.collator._encode_all(examples)[0]]
    assert max(lengths) > setup.stock.config.text_config.sliding_window, lengths
    result = compare(setup, examples)
    print("paligemma2", result)
    assert_exact(result)


@torch.no_grad()
def test_paligemma2_each_rule_is_needed(monkeypatch):
    """Each Gemma 2 rule dropped breaks the comparison: the attention softcap, the sliding window, the window
    counted over the whole row (sliding layers reaching into the previous sample), the prefix block in the
    sliding layers, and the final logit softcap in the chunked loss."""
    setup = paligemma2()
    examples = _paligemma_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert_exact(errors(batch, packed_logits(setup.packed, batch), refs))
    plain = hf_model.varlen_attention
    row = torch.tensor([0, batch["input_ids"].shape[1]], dtype=torch.int32)

    def whole_row(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return plain(q, k, v, row, row, None, None, **kw) if kw["window"] else plain(q, k, v, cu_q, cu_k, max_q,
                                                                                    max_k, **kw)

    corruptions = {
        "softcap dropped": lambda *a, **k: plain(*a, **{**k, "softcap": None}),
        "window dropped": lambda *a, **k: plain(*a, **{**k, "window": None}),
        "window over the whole row": whole_row,
        "no prefix block in sliding layers": lambda *a, **k: plain(*a, **{**k, "block_ids": None}
                                                                   if k["window"] else k),
    }
    for name, corrupt in corruptions.items():
        monkeypatch.setattr(hf_model, "varlen_attention", corrupt)
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs)), name
    monkeypatch.undo()
    token_mean = sum(loss * n for loss, n in zip(refs[1], refs[2])) / sum(refs[2])
    chunked = enable_packing(tiny_vlm("paligemma2", setup.processor, attn_implementation="eager")).train()
    assert chunked._vlm_pack_logit_transform == {"softcap": 5.0}  # LOGIT_TRANSFORMS, read by enable_packing
    refs[3].loss.check((chunked(**batch).loss - token_mean).abs().item(), "the chunked training loss")
    monkeypatch.setattr(chunked, "_vlm_pack_logit_transform", {"softcap": None})
    assert refs[3].loss.is_far((chunked(**batch).loss - token_mean).abs().item()), "final softcap dropped"


@torch.no_grad()
def test_paligemma2_prefix_longer_than_the_window_is_refused(monkeypatch):
    """transformers' sliding mask lets a prefix see itself past the window, the packed attention does not: a prefix
    longer than the window is refused by name, not approximated."""
    setup = paligemma2()
    batch = setup.collator(_paligemma_examples())
    monkeypatch.setattr(setup.packed.config.text_config, "sliding_window", 20)
    with pytest.raises(ValueError, match=r"PaliGemma 2 prefix .* of 34 tokens > sliding_window=20"):
        packed_logits(setup.packed, batch)


SOFTCAP = 1.5


def _capped_case(dtype=torch.float32):
    cu = cu_of([9, 4, 13])
    q, k, v = (x * 3 for x in random_qkv(26, 26, 4, 2, 8, seed=7))  # scores well past the cap
    q, k, v = (x.to(dtype) for x in (q, k, v))
    want = reference(q, k, v, cu, cu, causal=True, window=(5, 5), scale=0.3, softcap=SOFTCAP)
    uncapped = reference(q, k, v, cu, cu, causal=True, window=(5, 5), scale=0.3)
    assert (want - uncapped).abs().max() > 0.1  # the cap bites
    return q, k, v, cu, want


@torch.no_grad()
def test_softcap_on_the_cpu_paths_and_flex(monkeypatch):
    """The exact per-segment path, its torch.compile variant (one row mask), the unpacked dense path and flex
    (eager here) apply the cap; each agrees with the float64 reference, and without the cap each would not."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: flex_attention)
    q, k, v, cu, want = _capped_case()
    outs = {
        "sdpa_segments": varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP),
        "row mask": attention._sdpa_row_mask(q, k, v, cu, cu, True, 0.3, (5, 5), None, SOFTCAP),
        "flex": varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP,
                                 backend="flex"),
    }
    lone = q[:9].transpose(0, 1)[None], k[:9].transpose(0, 1)[None], v[:9].transpose(0, 1)[None]
    dense = dense_attention(*lone, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP)[0].transpose(0, 1)
    outs["dense (first sample)"] = torch.cat([dense, want[9:].float()])
    bound = float(want.abs().max()) * 2 ** -16  # 256 fp32 ulps of the output's scale (26 keys, fp32 sums)
    for name, out in outs.items():
        assert (out.double() - want).abs().max() < bound, name
    assert available_backends()["sdpa_segments"].softcap and available_backends()["flex"].softcap


def test_softcap_routing_and_refusals(monkeypatch):
    """On CUDA in half precision, "auto" sends a softcapped call to flash-attn (>= 2.6, the recording fake bound to
    its real signature receives ``softcap``), else to flex, never to torch varlen or TransformerEngine, which refuse
    it by name when forced (so does a flash-attn without the keyword)."""
    kernels = FakeKernels(monkeypatch)
    real = attention._auto_backend  # softcapped calls without image blocks resolved as on CUDA, the rest as before
    monkeypatch.setattr(attention, "_auto_backend", lambda d, dtype, blocks, softcap: (
        select_backend("cuda", dtype, softcap=True) if softcap and not blocks else real(d, dtype, blocks, softcap)))
    q, k, v, cu, want = _capped_case(torch.bfloat16)
    out = varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP)
    assert [(name, call["softcap"]) for name, call in kernels.calls] == [("flash_attn", SOFTCAP)]
    assert (out.double() - want).abs().max() <= float(want.abs().max()) * 2 ** -8  # the fake's bf16 rounding
    for backend in ("torch_varlen", "transformer_engine"):
        assert not available_backends()[backend].softcap
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot apply attention-logit softcapping"):
            varlen_attention(q, k, v, cu, cu, 13, 13, softcap=SOFTCAP, backend=backend)
    assert [name for name, _ in kernels.calls] == ["flash_attn"]  # refused before any kernel ran
    assert select_backend("cuda", torch.bfloat16) == "flash_attn"
    fake_machine(monkeypatch, cuda=True, installed={"flash_attn", "transformer_engine"}, flash_softcap=False)
    assert "no softcap keyword" in available_backends()["flash_attn"].reason
    assert select_backend("cuda", torch.bfloat16, softcap=True) == "flex"
    assert select_backend("cuda", torch.bfloat16) == "flash_attn"
    with pytest.raises(ValueError, match="backend 'flash_attn' cannot apply attention-logit softcapping"):
        varlen_attention(q, k, v, cu, cu, 13, 13, softcap=SOFTCAP, backend="flash_attn")
    fake_machine(monkeypatch, cuda=True, installed={"transformer_engine"})
    assert select_backend("cuda", torch.float16, softcap=True) == "flex"
    assert select_backend("cpu", torch.bfloat16, softcap=True) == "sdpa_segments"
