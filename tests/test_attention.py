"""varlen_attention: every backend on this machine against a naive masked-attention reference."""

from __future__ import annotations

import inspect
import sys
import types
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from vlm_pack.attention import varlen as attention
from vlm_pack.attention.varlen import (
    BACKENDS,
    available_backends,
    dense_attention,
    document_block_mask,
    select_backend,
    varlen_attention,
)

ATOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    """Run flex uncompiled: the same math, without ~30 s of CPU compilation per process (the benchmark
    exercises the compiled kernel)."""
    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: flex_attention)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def allowed_pairs(cu_q, cu_k, causal, window) -> torch.Tensor:
    """Dense [Tq, Tk] truth table written from the definition, one segment at a time."""
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    cq, ck = cu_q.tolist(), cu_k.tolist()
    allowed = torch.zeros(cq[-1], ck[-1], dtype=torch.bool)
    for s in range(len(cq) - 1):
        lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        i = torch.arange(lq).unsqueeze(1) + (lk - lq)  # bottom-right aligned query position
        j = torch.arange(lk).unsqueeze(0)
        ok = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            ok &= j <= i + right
        if left >= 0:
            ok &= j >= i - left
        allowed[cq[s]:cq[s + 1], ck[s]:ck[s + 1]] = ok
    return allowed


def reference(q, k, v, cu_q, cu_k, *, causal, window=None, scale=None, softcap=None):
    """Naive masked attention in float64 over the whole row; rows with no key give 0; ``softcap``: scores capped to
    ``softcap * tanh(score / softcap)``."""
    allowed = allowed_pairs(cu_q, cu_k, causal, window)
    rep = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v64)


def cpu_backends() -> list[str]:
    status = available_backends()
    return [name for name in BACKENDS if status[name].available]


def random_qkv(tq, tk, hq, hkv, d, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tq, hq, d, generator=g), torch.randn(tk, hkv, d, generator=g),
               torch.randn(tk, hkv, d, generator=g)]
    return [t.requires_grad_(requires_grad) for t in tensors]


def zipf_lengths(n, max_len, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.5, size=n), max_len)


# (name, segment lengths): 1..64 segments, lengths 1..2048; totals kept <= ~4k so the reference stays fast.
PACKS = [
    ("one_long", [2048]),
    ("two", [1, 777]),
    ("ones", [1] * 64),
    ("64_zipf", zipf_lengths(64, 512, seed=1).tolist()),
    ("7_mixed", [3, 2048, 1, 130, 128, 127, 5]),
    ("equal_groups", [64, 64, 3, 64, 3, 200, 200]),
]


# Flex runs eagerly here (seconds per 2k-token case), so it gets half of the grid: causal + GQA, full + MHA.
@pytest.mark.parametrize("causal,hkv", [(True, 1), (False, 2), (True, 2), (False, 1)],
                         ids=["causal-gqa2", "full-mha", "causal-mha", "full-gqa2"])
@pytest.mark.parametrize("name,lengths", PACKS, ids=[p[0] for p in PACKS])
def test_forward_matches_reference(name, lengths, causal, hkv):
    cu = cu_of(lengths)
    q, k, v = random_qkv(int(cu[-1]), int(cu[-1]), 2, hkv, 8, seed=len(lengths))
    expected = reference(q, k, v, cu, cu, causal=causal)
    backends = cpu_backends() if causal == (hkv == 1) else ["sdpa_segments"]
    for backend in backends:
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, backend=backend)
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0, msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize(
    "name,lengths,causal",
    [("7_mixed", PACKS[4][1], True), ("64_zipf", PACKS[3][1], False), ("two", PACKS[1][1], False)],
    ids=["7_mixed-causal", "64_zipf-full", "two-full"],
)
def test_backward_matches_reference(name, lengths, causal):
    """Gradients of q, k, v (GQA 4:2) agree with autograd through the reference."""
    cu = cu_of(lengths)
    t = int(cu[-1])
    q, k, v = random_qkv(t, t, 4, 2, 8, seed=7, requires_grad=True)
    grad_out = torch.randn(t, 4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.autograd.grad((reference(q, k, v, cu, cu, causal=causal) * grad_out).sum(), (q, k, v))
    out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, backend="sdpa_segments")
    got = torch.autograd.grad((out.double() * grad_out).sum(), (q, k, v))
    for name_, g, e in zip("qkv", got, expected):
        torch.testing.assert_close(g.double(), e.double(), atol=ATOL, rtol=0, msg=lambda m: f"d{name_}: {m}")


def test_flex_has_no_cpu_backward_and_says_so():
    cu = cu_of([3, 5])
    q, k, v = random_qkv(8, 8, 2, 2, 8, seed=0, requires_grad=True)
    with pytest.raises(NotImplementedError, match="sdpa_segments"):
        varlen_attention(q, k, v, cu, cu, 5, 5, backend="flex")


@settings(max_examples=30, deadline=None)
@given(
    lengths_q=st.lists(st.integers(0, 40), min_size=1, max_size=10),
    data=st.data(),
    hkv=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (3, 2), (-1, 4), (5, -1)]),
)
def test_random_packs_with_cross_lengths_and_windows(lengths_q, data, hkv, causal, window):
    """Empty segments, Lq != Lk (bottom-right causal), sliding windows, rows with no key at all."""
    self_attention = data.draw(st.booleans())
    lengths_k = lengths_q if self_attention else data.draw(
        st.lists(st.integers(0, 40), min_size=len(lengths_q), max_size=len(lengths_q)))
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, hkv, 8, seed=sum(lengths_q))
    expected = reference(q, k, v, cu_q, cu_k, causal=causal, window=window, scale=0.3)
    for backend in cpu_backends():
        out = varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                               window=window, softmax_scale=0.3, backend=backend)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0, msg=lambda m: f"{backend}: {m}")
    if q.shape[0] and k.shape[0]:  # the whole-row mask path that runs inside torch.compile
        out = attention._sdpa_row_mask(q, k, v, cu_q, cu_q if self_attention else cu_k, causal, 0.3, window)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0, msg=lambda m: f"row mask: {m}")


def test_window_backward_with_empty_rows_is_finite_and_exact():
    cu_q, cu_k = cu_of([6, 4, 3]), cu_of([2, 0, 9])
    q, k, v = random_qkv(13, 11, 2, 1, 8, seed=5, requires_grad=True)
    expected = torch.autograd.grad(reference(q, k, v, cu_q, cu_k, causal=True, window=(1, 0)).sum(), (q, k, v))
    out = varlen_attention(q, k, v, cu_q, cu_k, 6, 9, causal=True, window=(1, 0), backend="sdpa_segments")
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, e in zip(got, expected):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), e.double(), atol=ATOL, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    lengths_q=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    data=st.data(),
    causal=st.booleans(),
    window=st.sampled_from([None, (3, 2), (0, -1), (-1, 5), (7, 0)]),
)
def test_document_block_mask_skips_only_empty_blocks(lengths_q, data, causal, window):
    """Eager flex ignores block sparsity, so check the BlockMask itself: every allowed pair lies in a kept block,
    every block marked full is fully allowed, and mask_mod equals the definition."""
    lengths_k = data.draw(st.one_of(st.just(lengths_q), st.lists(st.integers(0, 30), min_size=len(lengths_q),
                                                                 max_size=len(lengths_q))))
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    tq, tk, b = int(cu_q[-1]), int(cu_k[-1]), 4
    if tq == 0 or tk == 0:
        return
    mask = document_block_mask(cu_q, cu_k, tq, tk, causal=causal, window=window, block_size=b)
    truth = allowed_pairs(cu_q, cu_k, causal, window)
    nq, nk = -(-tq // b), -(-tk // b)
    padded = torch.zeros(nq * b, nk * b, dtype=torch.bool)
    padded[:tq, :tk] = truth
    inside = torch.zeros_like(padded)
    inside[:tq, :tk] = True
    any_allowed = padded.view(nq, b, nk, b).any(dim=(1, 3))
    all_allowed = (padded | ~inside).view(nq, b, nk, b).all(dim=(1, 3))
    kept = mask.to_dense()[0, 0].bool()
    assert (kept | ~any_allowed).all(), "a block holding an allowed pair was skipped"
    full = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        full[i, mask.full_kv_indices[0, 0, i, :mask.full_kv_num_blocks[0, 0, i]].long()] = True
    assert (all_allowed | ~full).all(), "a block marked full holds a masked pair"
    assert torch.equal(mask.mask_mod(0, 0, torch.arange(tq)[:, None], torch.arange(tk)[None]), truth)


def test_document_block_mask_is_sparse():
    """Causal packs of 8 x 512 tokens keep ~1/16 of the 4096^2 pairs' blocks, not all of them."""
    cu = cu_of([512] * 8)
    mask = document_block_mask(cu, cu, 4096, 4096, causal=True)
    kept = mask.to_dense().sum().item()
    assert kept == 8 * (4 * 5 // 2)  # 4 blocks per segment, lower triangle incl. diagonal


def test_sdpa_segments_syncs_once_and_batches_equal_lengths(monkeypatch):
    """One host read of cu_seqlens per call; one SDPA call per distinct segment length."""
    lengths = [5, 9, 5, 5, 9, 1] * 10
    cu = cu_of(lengths)
    q, k, v = random_qkv(int(cu[-1]), int(cu[-1]), 2, 2, 8, seed=0)
    tolist, sdpa = torch.Tensor.tolist, F.scaled_dot_product_attention
    calls = {"tolist": 0, "sdpa": 0}

    def counting_tolist(self):
        calls["tolist"] += 1
        return tolist(self)

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    out = varlen_attention(q, k, v, cu, cu, 9, 9, backend="sdpa_segments")
    assert calls == {"tolist": 1, "sdpa": 3}
    monkeypatch.undo()
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, cu, causal=True), atol=ATOL, rtol=0)


def test_dense_attention_is_bottom_right_causal():
    """A 3-token query chunk over 7 cached keys sees keys 0..4, 0..5, 0..6 (like one varlen segment)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8,
                                                                                                      generator=g)
    out = dense_attention(q, k, v, causal=True)
    for row in range(2):
        expected = reference(q[row].transpose(0, 1), k[row].transpose(0, 1), v[row].transpose(0, 1), cu_of([3]),
                             cu_of([7]), causal=True)
        torch.testing.assert_close(out[row].transpose(0, 1).double(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(cu_k=cu_of([3, 4])), "PHYSICAL"),  # logical offsets that stop short of T
        (dict(q=torch.zeros(1, 10, 2, 8)), r"THD"),
        (dict(k=torch.zeros(10, 3, 8), v=torch.zeros(10, 3, 8)), "multiple"),
        (dict(cu_k=cu_of([4, 6])[None]), "1-D"),
        (dict(window=(2,)), "window"),
    ],
    ids=["logical_cu", "4d", "heads", "2d_cu", "window"],
)
def test_bad_inputs_raise_clear_errors(bad, match):
    args = dict(q=torch.zeros(10, 4, 8), k=torch.zeros(10, 2, 8), v=torch.zeros(10, 2, 8), cu_q=cu_of([4, 6]),
                cu_k=cu_of([4, 6]), window=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], 6, 6, window=args["window"],
                         backend="sdpa_segments")


def test_unknown_and_unavailable_backends(monkeypatch):
    q, cu = torch.zeros(4, 2, 8), cu_of([4])
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(q, q, q, cu, cu, 4, 4, backend="xformers")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch_varlen.*CUDA"):
        varlen_attention(q, q, q, cu, cu, 4, 4, backend="torch_varlen")


def fake_machine(monkeypatch, *, cuda: bool, installed: set[str], torch_varlen: bool = True,
                 flash_softcap: bool = True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(attention, "_import_error", lambda name: None if name in installed else "not installed")
    monkeypatch.setattr(attention, "_torch_varlen_error", lambda: None if torch_varlen else "torch is too old")
    monkeypatch.setattr(attention, "_flash_softcap", lambda: flash_softcap)  # flash-attn >= 2.6 takes softcap


@pytest.mark.parametrize(
    "cuda,installed,torch_varlen,dtype,expected",
    [
        (False, {"flash_attn", "transformer_engine"}, True, torch.bfloat16, "sdpa_segments"),  # no CUDA
        (True, {"flash_attn", "transformer_engine"}, True, torch.bfloat16, "flash_attn"),
        (True, {"transformer_engine"}, True, torch.float16, "torch_varlen"),  # no flash-attn
        (True, {"transformer_engine"}, False, torch.bfloat16, "transformer_engine"),
        (True, set(), False, torch.bfloat16, "sdpa_segments"),
        (True, {"flash_attn"}, True, torch.float32, "sdpa_segments"),  # fp32: the exact path
    ],
)
def test_backend_selection(monkeypatch, cuda, installed, torch_varlen, dtype, expected):
    fake_machine(monkeypatch, cuda=cuda, installed=installed, torch_varlen=torch_varlen)
    assert select_backend("cuda", dtype) == expected
    assert select_backend("cpu", dtype) == "sdpa_segments"


def test_available_backends_explain_why_not(monkeypatch):
    fake_machine(monkeypatch, cuda=False, installed=set())
    status = available_backends()
    assert set(status) == set(BACKENDS)
    assert not status["flash_attn"].available
    assert status["flash_attn"].reason.startswith("flash-attn is not installed (pip install flash-attn)")
    assert not status["flash_attn"].image_blocks and status["flex"].image_blocks
    assert not status["torch_varlen"].available and "CUDA" in status["torch_varlen"].reason
    assert status["sdpa_segments"].available and status["flex"].available


def test_auto_on_cpu_is_the_exact_segment_path(monkeypatch):
    seen = []
    monkeypatch.setattr(attention, "_sdpa_segments", lambda *a: seen.append("sdpa_segments") or a[0])
    q, cu = torch.zeros(4, 2, 8), cu_of([4])
    varlen_attention(q, q, q, cu, cu, 4, 4)
    assert seen == ["sdpa_segments"]


# ----------------------------------------------------------------------------------------- GPU only


def gpu_backends() -> list[str]:
    status = available_backends()
    return [name for name in BACKENDS if status[name].available and name != "sdpa_segments"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_backends_match_reference_bf16(monkeypatch, causal):
    """Every CUDA kernel (torch_varlen, flash_attn, TE, compiled flex) vs the reference, forward and backward."""
    monkeypatch.setattr(attention, "_flex_kernel", attention._compiled_flex)
    lengths = [3, 2048, 1, 130, 128, 127, 5] + [1] * 20
    cu = cu_of(lengths).cuda()
    t = int(cu[-1])
    q, k, v = (x.cuda().bfloat16().requires_grad_() for x in random_qkv(t, t, 8, 2, 64, seed=0))
    grad_out = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_k, ref_v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    expected = reference(ref_q, ref_k, ref_v, cu.cpu(), cu.cpu(), causal=causal)
    ref_grads = torch.autograd.grad((expected * grad_out.cpu().double()).sum(), (ref_q, ref_k, ref_v))
    assert gpu_backends(), "a CUDA machine should at least have torch_varlen or flex"
    for backend in gpu_backends():
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, backend=backend)
        torch.testing.assert_close(out.double().cpu(), expected.detach(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")
        grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
        for g, e in zip(grads, ref_grads):
            torch.testing.assert_close(g.double().cpu(), e, atol=5e-2, rtol=5e-2, msg=lambda m: f"{backend}: {m}")


# ------------------------------------------------------------------ grouped-query attention, Hq=4 / Hkv=2


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (2, 0)), (False, (3, 1))],
                         ids=["causal", "full", "causal-window", "full-window"])
def test_gqa_four_query_heads_on_two_kv_heads(causal, window):
    """Query heads 0, 1 read KV head 0 and heads 2, 3 read KV head 1 (repeat_interleave, as in HF's repeat_kv);
    the reference with the other mapping (heads 0, 2 -> KV 0) is far off, so the test tells them apart."""
    cu = cu_of([5, 1, 8, 3])
    q, k, v = random_qkv(17, 17, 4, 2, 8, seed=11)
    expected = reference(q, k, v, cu, cu, causal=causal, window=window)
    interleaved_wrongly = reference(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), cu, cu, causal=causal, window=window)
    assert (expected - interleaved_wrongly).abs().max() > 0.1
    for backend in cpu_backends() if window is None else ["sdpa_segments"]:  # eager flex is slow: windows once
        out = varlen_attention(q, k, v, cu, cu, 8, 8, causal=causal, window=window, backend=backend)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0, msg=lambda m: f"{backend}: {m}")


# ---------------------------------------------- GPU kernels on CPU: recording fakes check what they are passed


FLASH_WINDOWS = {  # (causal, window asked for) -> (left, right) every kernel must receive
    (True, None): (-1, 0), (False, None): (-1, -1), (True, (3, 2)): (3, 0), (False, (3, 2)): (3, 2),
}


def emulate(q, k, v, cu_q, cu_k, window, scale, softcap=None):
    """What a correct kernel returns for the arguments it RECEIVED (window carries causality, right = 0)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return reference(q, k, v, cu_q, cu_k, causal=False, window=tuple(window), scale=scale,
                     softcap=softcap).to(q.dtype)


def torch_2_11_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                           window_size=(-1, -1)):
    """torch 2.11.0's ``torch.nn.attention.varlen.varlen_attn`` signature (no ``enable_gqa``), for binding only."""
    raise AssertionError("a signature, never called")


class FakeKernels:
    """Installs recording stand-ins for flash-attn, torch's varlen_attn and TransformerEngine, with the real
    keyword names (a renamed argument fails to bind), and makes them look available on a CUDA machine.

    ``varlen_signature``: the varlen_attn signature to bind to (default: this torch's); the wrapper's probe of
    ``enable_gqa`` reads it, as it reads the real function's."""

    def __init__(self, monkeypatch, varlen_signature: inspect.Signature | None = None):
        self.calls: list[tuple[str, dict]] = []
        fake_machine(monkeypatch, cuda=True, installed={"flash_attn", "transformer_engine"})
        flash = types.ModuleType("flash_attn")
        flash.flash_attn_varlen_func = self.flash_attn_varlen_func
        te, te_pytorch = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
        te_pytorch.DotProductAttention = self.dot_product_attention_class()
        te.pytorch = te_pytorch
        monkeypatch.setitem(sys.modules, "flash_attn", flash)
        monkeypatch.setitem(sys.modules, "transformer_engine", te)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pytorch)
        import torch.nn.attention.varlen as torch_varlen

        self.varlen_signature = varlen_signature or inspect.signature(torch_varlen.varlen_attn)

        def varlen_attn(*args, **kwargs):
            return self.varlen_attn(*args, **kwargs)

        varlen_attn.__signature__ = self.varlen_signature
        monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
        # A probe cache of this test's own (the fake's signature must not outlive it).
        monkeypatch.setattr(attention, "_torch_varlen_gqa", lru_cache(attention._torch_varlen_gqa.__wrapped__))
        attention._te_module.cache_clear()

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        # flash-attn 2.8's own checks (csrc/flash_attn/flash_api.cpp, mha_varlen_fwd): fp16/bf16 only, one head
        # dim for q, k and v, query heads a multiple of key heads (its CUDA-only check cannot run here).
        assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "head dims of q, k, v must match"
        assert q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query"
        self.calls.append(("flash_attn", dict(q=q, k=k, v=v, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_q=max_seqlen_q,
                                              max_k=max_seqlen_k, scale=softmax_scale, window=tuple(window_size),
                                              causal=causal, dropout_p=dropout_p, deterministic=deterministic,
                                              softcap=softcap)))
        left, right = window_size
        return emulate(q, k, v, cu_seqlens_q, cu_seqlens_k, (left, 0 if causal else right), softmax_scale,
                       softcap or None)

    def varlen_attn(self, *args, **kwargs):
        bound = self.varlen_signature.bind(*args, **kwargs)  # the call must fit torch's real signature
        bound.apply_defaults()
        a = bound.arguments
        if "enable_gqa" not in a:  # torch 2.11: one key/value head per query head
            assert a["query"].shape[1] == a["key"].shape[1] == a["value"].shape[1], "heads differ without enable_gqa"
        self.calls.append(("torch_varlen", dict(q=a["query"], k=a["key"], v=a["value"], cu_q=a["cu_seq_q"],
                                                cu_k=a["cu_seq_k"], max_q=a["max_q"], max_k=a["max_k"],
                                                scale=a["scale"], window=tuple(a["window_size"]),
                                                enable_gqa=a.get("enable_gqa"))))
        return emulate(a["query"], a["key"], a["value"], a["cu_seq_q"], a["cu_seq_k"], a["window_size"], a["scale"])

    def dot_product_attention_class(self):
        calls = self.calls

        class DotProductAttention:
            def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                         qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False,
                         tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                         attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                         cp_comm_type="p2p", softmax_scale=None):
                self.init = dict(heads=num_attention_heads, head_dim=kv_channels, kv_heads=num_gqa_groups,
                                 dropout=attention_dropout, qkv_format=qkv_format, scale=softmax_scale)

            def __call__(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                         cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                         max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None):
                calls.append(("transformer_engine", dict(
                    q=query_layer, k=key_layer, v=value_layer, cu_q=cu_seqlens_q, cu_k=cu_seqlens_kv,
                    max_q=max_seqlen_q, max_k=max_seqlen_kv, scale=self.init["scale"], window=tuple(window_size),
                    init=self.init, qkv_format=qkv_format, mask_type=attn_mask_type,
                    padded=(cu_seqlens_q_padded, cu_seqlens_kv_padded))))
                assert attn_mask_type in ("padding", "padding_causal_bottom_right"), attn_mask_type
                window = te_check_set_window_size(attn_mask_type, tuple(window_size))
                out = emulate(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv, window,
                              self.init["scale"])
                return out.reshape(out.shape[0], -1)  # TE returns THD with heads flattened: [T, H * D]

        return DotProductAttention


def te_check_set_window_size(attn_mask_type: str, window: tuple[int, int]) -> tuple[int, int]:
    """TransformerEngine 2.x's ``check_set_window_size`` rule (transformer_engine/pytorch/attention/
    dot_product_attention/utils.py): causal masks keep ``(left, 0)``; padding masks take ``(-1, -1)`` or two
    bounds >= 0, ASSERT on one unbounded side and silently turn ``(-1, 0)`` into full attention."""
    if "causal" in attn_mask_type:
        if window == (-1, -1) or (window[0] >= 0 and window[1] != 0):
            return window[0], 0
        assert window == (-1, 0) or (window[0] >= 0 and window[1] == 0), f"window_size {window} for {attn_mask_type}"
        return window
    if window == (-1, 0):
        return -1, -1  # TE warns and attends to everything
    assert window == (-1, -1) or (window[0] >= 0 and window[1] >= 0), f"window_size {window} for {attn_mask_type}"
    return window


KERNEL_CASES = [(backend, causal, window, scale) for backend in ("flash_attn", "torch_varlen", "transformer_engine")
                for causal, window in FLASH_WINDOWS for scale in (None, 0.3)]


@pytest.mark.parametrize("backend,causal,window,scale", KERNEL_CASES,
                         ids=[f"{b}-{'causal' if c else 'full'}-{w}-{s}" for b, c, w, s in KERNEL_CASES])
def test_gpu_kernels_get_int32_boundaries_int_lengths_and_the_window(monkeypatch, backend, causal, window, scale):
    kernels = FakeKernels(monkeypatch)
    lengths = [3, 5, 1]
    cu = cu_of(lengths).long()  # int64 from the caller: the kernel must still get int32
    q, k, v = (x.bfloat16() for x in random_qkv(9, 9, 4, 2, 8, seed=2))
    out = varlen_attention(q, k, v, cu, cu, torch.tensor(5), torch.tensor(5), causal=causal, window=window,
                           softmax_scale=scale, backend=backend)
    ((name, call),) = kernels.calls
    assert name == backend
    assert call["cu_q"].dtype == call["cu_k"].dtype == torch.int32 and call["cu_q"].tolist() == cu.tolist()
    assert type(call["max_q"]) is int and type(call["max_k"]) is int and call["max_q"] == call["max_k"] == 5
    assert call["window"] == FLASH_WINDOWS[(causal, window)]
    assert call["scale"] == scale
    assert all(call[x].dtype == torch.bfloat16 for x in "qkv")  # no upcast
    native_gqa = backend != "torch_varlen" or "enable_gqa" in kernels.varlen_signature.parameters
    assert call["k"].shape[1] == call["v"].shape[1] == (2 if native_gqa else 4)  # KV repeated on torch 2.11 only
    if backend == "flash_attn":
        assert call["causal"] is causal and call["dropout_p"] == 0.0 and call["deterministic"] is False
    if backend == "torch_varlen":
        assert call["enable_gqa"] is (True if native_gqa else None)
    if backend == "transformer_engine":
        assert call["qkv_format"] == call["init"]["qkv_format"] == "thd"
        assert call["init"]["heads"] == 4 and call["init"]["kv_heads"] == 2 and call["init"]["head_dim"] == 8
        assert call["init"]["dropout"] == 0.0 and call["padded"] == (None, None)
        assert call["mask_type"] == ("padding_causal_bottom_right" if causal else "padding")
    expected = emulate(q, k, v, cu, cu, FLASH_WINDOWS[(causal, window)], scale)
    assert out.shape == q.shape and torch.equal(out, expected)
    attention._te_module.cache_clear()


TORCH_2_11_CASES = [(causal, window, hkv) for causal, window in FLASH_WINDOWS for hkv in (1, 2, 4)]


@pytest.mark.parametrize("causal,window,hkv", TORCH_2_11_CASES,
                         ids=[f"{'causal' if c else 'full'}-{w}-kv{h}" for c, w, h in TORCH_2_11_CASES])
def test_torch_2_11_varlen_attn_gets_repeated_key_value_heads(monkeypatch, causal, window, hkv):
    """torch 2.11's varlen_attn has no enable_gqa: the wrapper repeats each KV head for its query group (query head
    h reads KV head h // group) and the result is the reference's, forward and backward."""
    kernels = FakeKernels(monkeypatch, inspect.signature(torch_2_11_varlen_attn))
    assert available_backends()["torch_varlen"].available
    cu = cu_of([3, 6, 1, 4])
    q, k, v = (x.bfloat16().requires_grad_() for x in random_qkv(14, 14, 4, hkv, 8, seed=hkv))
    out = varlen_attention(q, k, v, cu, cu, 6, 6, causal=causal, window=window, backend="torch_varlen")
    ((name, call),) = kernels.calls
    assert name == "torch_varlen" and call["enable_gqa"] is None and call["k"].shape[1] == call["v"].shape[1] == 4
    assert call["window"] == FLASH_WINDOWS[(causal, window)]
    expected = reference(q.detach().double(), k.detach().double(), v.detach().double(), cu, cu, causal=causal,
                         window=window)
    # bf16 inputs, fp64 math inside the fake: the only error is the bf16 rounding of the output
    torch.testing.assert_close(out.double(), expected, atol=2 ** -8 * expected.abs().max().item(), rtol=0)
    out.double().mul(expected).sum().backward()  # gradients flow back through the repeat to the KV heads
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    reference(q64, k64, v64, cu, cu, causal=causal, window=window).mul(expected).sum().backward()
    for got, want in ((k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=2 ** -7 * want.abs().max().item(), rtol=0)


def test_torch_varlen_repeat_is_what_a_wrong_grouping_would_fail(monkeypatch):
    """Corruption check: KV heads tiled (h % Hkv) instead of grouped (h // group) must not pass for the reference."""
    FakeKernels(monkeypatch, inspect.signature(torch_2_11_varlen_attn))
    cu = cu_of([5, 4])
    q, k, v = (x.bfloat16() for x in random_qkv(9, 9, 4, 2, 8, seed=3))
    expected = reference(q.double(), k.double(), v.double(), cu, cu, causal=True)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda x, n, dim: x.repeat(*[n if d == dim else 1
                                                                                        for d in range(x.dim())]))
    out = varlen_attention(q, k, v, cu, cu, 5, 5, backend="torch_varlen")
    assert (out.double() - expected).abs().max() > 0.1


@pytest.mark.parametrize("installed,torch_varlen,expected", [
    ({"flash_attn", "transformer_engine"}, True, "flash_attn"),
    ({"transformer_engine"}, True, "torch_varlen"),
    ({"transformer_engine"}, False, "transformer_engine"),
])
def test_auto_routes_half_precision_cuda_tensors_to_the_kernel(monkeypatch, installed, torch_varlen, expected):
    """``backend="auto"`` as on a CUDA machine (the tensors stay on CPU; the device probe is faked)."""
    kernels = FakeKernels(monkeypatch)
    fake_machine(monkeypatch, cuda=True, installed=installed, torch_varlen=torch_varlen)
    monkeypatch.setattr(attention, "_auto_backend", lambda device_type, dtype, blocks, softcap: select_backend(
        "cuda", dtype, image_blocks=blocks, softcap=softcap))
    cu = cu_of([2, 4])
    q, k, v = (x.half() for x in random_qkv(6, 6, 2, 2, 8, seed=4))
    varlen_attention(q, k, v, cu, cu, 4, 4)
    assert [name for name, _ in kernels.calls] == [expected]
    attention._te_module.cache_clear()


# Non-causal windows with one side unbounded, or a right bound of 0: TE asserts on the first, and silently
# attends everywhere for (-1, 0); the wrapper must keep each window's meaning.
TE_WINDOWS = [(False, (3, -1)), (False, (-1, 2)), (False, (-1, 0)), (False, (2, 0)), (True, (-1, 4)), (True, None)]


@pytest.mark.parametrize("causal,window", TE_WINDOWS, ids=[f"{c}-{w}" for c, w in TE_WINDOWS])
def test_transformer_engine_windows_keep_their_meaning(monkeypatch, causal, window):
    FakeKernels(monkeypatch)
    cu = cu_of([7, 3, 9])
    q, k, v = (x.bfloat16() for x in random_qkv(19, 19, 2, 1, 8, seed=6))
    out = varlen_attention(q, k, v, cu, cu, 9, 9, causal=causal, window=window, backend="transformer_engine")
    expected = reference(q.float(), k.float(), v.float(), cu, cu, causal=causal, window=window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)
    attention._te_module.cache_clear()


def test_flash_attn_passes_deterministic(monkeypatch):
    kernels = FakeKernels(monkeypatch)
    cu = cu_of([3, 5])
    q, k, v = (x.bfloat16() for x in random_qkv(8, 8, 2, 2, 8, seed=1))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    varlen_attention(q, k, v, cu, cu, 5, 5, backend="flash_attn")
    assert kernels.calls[-1][1]["deterministic"] is True


@pytest.mark.parametrize("backend", ["flash_attn", "transformer_engine"])
def test_kernels_refuse_value_head_dim_unlike_query(monkeypatch, backend):
    FakeKernels(monkeypatch)
    cu = cu_of([3, 5])
    q, k, _ = (x.bfloat16() for x in random_qkv(8, 8, 2, 2, 8, seed=1))
    v = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="value head dim"):
        varlen_attention(q, k, v, cu, cu, 5, 5, backend=backend)
    attention._te_module.cache_clear()


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_kernels_refuse_fp32(monkeypatch, backend):
    FakeKernels(monkeypatch)
    cu = cu_of([3, 5])
    q, k, v = random_qkv(8, 8, 2, 2, 8, seed=1)
    with pytest.raises(ValueError, match="needs fp16/bf16"):
        varlen_attention(q, k, v, cu, cu, 5, 5, backend=backend)


# ------------------------------------------------------------------ probes import for real


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A flash-attn that is found but fails to import (a wheel built for another torch: undefined symbol)."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    attention._import_error.cache_clear()
    attention._auto_backend.cache_clear()
    yield
    attention._import_error.cache_clear()
    attention._auto_backend.cache_clear()


def test_flash_attn_that_fails_to_import_is_unavailable_and_auto_falls_back(broken_flash_attn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "_torch_varlen_error", lambda: None)
    status = available_backends()["flash_attn"]
    assert not status.available and "undefined symbol" in status.reason
    assert select_backend("cuda", torch.bfloat16) == "torch_varlen"


def test_flash_attn_namespace_without_the_kernel_is_unavailable(tmp_path, monkeypatch):
    """A flash-attn-4-only install leaves ``flash_attn`` a namespace package without flash_attn_varlen_func."""
    (tmp_path / "flash_attn").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    attention._import_error.cache_clear()
    try:
        reason = available_backends()["flash_attn"].reason
        assert not available_backends()["flash_attn"].available and "flash_attn_varlen_func" in reason
    finally:
        attention._import_error.cache_clear()


def test_torch_varlen_without_the_keywords_used_is_unavailable(monkeypatch):
    """torch 2.10's varlen_attn has no scale / window_size: calling it would raise TypeError."""
    import torch.nn.attention.varlen as torch_varlen

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
        raise AssertionError("never called")

    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    attention._torch_varlen_error.cache_clear()
    try:
        status = available_backends()["torch_varlen"]
        assert not status.available and "scale" in status.reason and "2.11" in status.reason
    finally:
        attention._torch_varlen_error.cache_clear()


def test_flex_builds_one_block_mask_per_batch_and_layer_kind(monkeypatch):
    """Layers of one forward share the boundaries tensor: the mask is built once per (causal, window) kind, and
    again for the next batch's boundaries."""
    built = []
    real = attention.document_block_mask
    monkeypatch.setattr(attention, "document_block_mask", lambda *a, **kw: built.append(kw["window"]) or real(*a, **kw))
    q, k, v = random_qkv(9, 9, 2, 2, 8, seed=0)
    for cu in (cu_of([3, 6]), cu_of([4, 5])):  # two batches
        for window in (None, (2, 2), None, (2, 2)):  # four layers, two kinds
            out = varlen_attention(q, k, v, cu, cu, 6, 6, window=window, backend="flex")
            torch.testing.assert_close(out.double(), reference(q, k, v, cu, cu, causal=True, window=window),
                                       atol=ATOL, rtol=0)
    assert built == [None, (2, 2), None, (2, 2)]


def test_doctor_prints_every_backend_and_why(broken_flash_attn, capsys):
    from vlm_pack.cli.main import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for name in BACKENDS:
        assert f"\n  {name} " in out
    assert "undefined symbol" in out  # the probe's own error, for the bug report
    assert "cpu float32   -> sdpa_segments" in out
