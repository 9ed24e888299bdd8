"""Variable-length (packed, THD) attention: one entry point routed to the best kernel available.

A packed row holds several samples back to back; ``cu_seqlens`` (int32 ``[N+1]``, physical boundaries) tells
the kernel where each one starts, so attention never crosses a boundary and costs ``sum(s_i^2)``.

Semantics shared by every backend (those of ``flash_attn_varlen_func``):

* layout THD: ``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``; grouped-query attention when
  ``Hkv < Hq`` (``Hq % Hkv == 0``, query head ``h`` reads KV head ``h // (Hq // Hkv)``);
* ``causal`` is aligned to the bottom-right corner of each segment's ``Lq x Lk`` block (they coincide
  for self-attention, ``Lq == Lk``);
* ``window=(left, right)`` keeps key ``j`` for query ``i`` when ``i' - left <= j <= i' + right`` with
  ``i' = i + Lk - Lq``; ``-1`` means unbounded, and ``causal`` forces ``right = 0``;
* a query row with no key to attend to (empty key segment, or a window that excludes every key) outputs 0.

Image blocks (Gemma 3 style, optional ``block_ids``): with ``causal=True`` and self-attention segments, tokens
sharing a block id ``>= 0`` also see each other both ways. The rule per (query ``i``, key ``j``) of one segment is
``(j <= i + right  OR  block[i] == block[j] >= 0)  AND  j >= i - left``: blocks lift the causal (right) bound
only, the left window bound still applies (transformers' ``AND(sliding_window, OR(causal, blockwise))``).
Only ``flex`` and ``sdpa_segments`` express it (``BackendStatus.image_blocks``); ``"auto"`` routes there.

Attention-logit softcapping (Gemma 2, optional ``softcap``): every score becomes ``softcap * tanh(score / softcap)``
(``score = q.k * softmax_scale``) before the mask and the softmax. ``sdpa_segments`` (the scores written out: SDPA
has no score hook), ``flex`` (a ``score_mod``) and ``flash_attn`` (flash-attn >= 2.6's ``softcap``) apply it
(``BackendStatus.softcap``); ``"auto"`` routes only there, and ``torch_varlen`` / ``transformer_engine``, whose
kernels have no such hook, refuse it by name.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..core.packing import segment_ids

__all__ = [
    "BACKENDS",
    "BackendStatus",
    "available_backends",
    "dense_attention",
    "document_block_mask",
    "sdpa",
    "select_backend",
    "varlen_attention",
]

BACKENDS: tuple[str, ...] = ("flash_attn", "torch_varlen", "transformer_engine", "flex", "sdpa_segments")
"""Every backend name ``varlen_attention`` accepts (besides ``"auto"``)."""

_CUDA_PREFERENCE: tuple[str, ...] = ("flash_attn", "torch_varlen", "transformer_engine")
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLEX_BLOCK = 128


class BackendStatus(NamedTuple):
    """Whether a backend can run on this machine, and why (not); ``image_blocks``: whether it can express
    bidirectional image blocks inside causal attention (``varlen_attention(block_ids=...)``); ``softcap``: whether it
    applies attention-logit softcapping (``varlen_attention(softcap=...)``)."""

    available: bool
    reason: str
    image_blocks: bool = False
    softcap: bool = False


# What each CUDA kernel's import must provide: (module, attribute) the wrapper calls.
_KERNEL_IMPORTS = {"flash_attn": ("flash_attn", "flash_attn_varlen_func"),
                   "transformer_engine": ("transformer_engine.pytorch", "DotProductAttention")}
# torch.nn.attention.varlen.varlen_attn keywords the wrapper needs (torch 2.11+; 2.10 has neither). ``enable_gqa``
# (torch 2.12+) is passed where it exists; before, the wrapper repeats the key/value heads itself.
_TORCH_VARLEN_KEYWORDS = ("scale", "window_size")


@lru_cache(maxsize=None)
def _import_error(name: str) -> str | None:
    """None when backend ``name``'s kernel imports for real (once, cached), else why not: a wheel built for
    another torch (``undefined symbol``) or an empty namespace package must not pass for an installed kernel."""
    module, attribute = _KERNEL_IMPORTS[name]
    try:
        getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as error:
        if error.name == module or module.startswith(f"{error.name}."):
            return "not installed"
        return f"import {module} failed: {type(error).__name__}: {error}"
    except Exception as error:  # ImportError (undefined symbol), AttributeError (no such kernel), OSError
        return f"import {module} failed: {type(error).__name__}: {error}"
    return None


@lru_cache(maxsize=None)
def _torch_varlen_error() -> str | None:
    """None when this torch ships ``varlen_attn`` with every keyword the wrapper passes, else why not."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.11 has it)"
    missing = [k for k in _TORCH_VARLEN_KEYWORDS if k not in inspect.signature(varlen_attn).parameters]
    if missing:
        return (f"torch {torch.__version__}'s varlen_attn lacks the keyword(s) {missing} (torch >= 2.11 has them); "
                "upgrade torch or use another backend")
    return None


@lru_cache(maxsize=None)
def _torch_varlen_gqa() -> bool:
    """True when this torch's ``varlen_attn`` takes ``enable_gqa`` (torch 2.12+)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


@lru_cache(maxsize=None)
def _flash_softcap() -> bool:
    """True when the installed ``flash_attn_varlen_func`` takes ``softcap`` (flash-attn >= 2.6)."""
    from flash_attn import flash_attn_varlen_func

    return "softcap" in inspect.signature(flash_attn_varlen_func).parameters


@lru_cache(maxsize=None)
def _has_flex() -> bool:
    """True when this torch build ships FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _install_hint(error: str | None, package: str, command: str) -> str | None:
    """The probe's error, worded for users: a missing package names its install command."""
    return f"{package} is not installed ({command})" if error == "not installed" else error


def available_backends() -> dict[str, BackendStatus]:
    """Probe every backend on this machine: ``{name: BackendStatus(available, reason)}``."""
    cuda = torch.cuda.is_available()
    no_cuda = "needs a CUDA device (torch.cuda.is_available() is False)"
    # CUDA kernels: (name, why it cannot run or None, what runs when it can)
    cuda_kernels = (
        ("flash_attn", _install_hint(_import_error("flash_attn"), "flash-attn", "pip install flash-attn"),
         "flash_attn_varlen_func"),
        ("torch_varlen", _torch_varlen_error(), "torch.nn.attention.varlen.varlen_attn"),
        ("transformer_engine", _install_hint(_import_error("transformer_engine"), "transformer-engine",
                                             "pip install transformer-engine[pytorch]"),
         "DotProductAttention(qkv_format='thd')"),
    )
    # Their masks are a causal/window band per segment: a query cannot see a later key of its own image.
    no_blocks = "; cannot express bidirectional image blocks (routed to flex / sdpa_segments)"
    status: dict[str, BackendStatus] = {
        name: BackendStatus(False, error + no_blocks) if error is not None
        else BackendStatus(cuda, (kernel if cuda else no_cuda) + no_blocks)
        for name, error, kernel in cuda_kernels
    }
    if _import_error("flash_attn") is None:
        capped = _flash_softcap()
        status["flash_attn"] = status["flash_attn"]._replace(softcap=capped, reason=status["flash_attn"].reason + (
            "" if capped else "; no softcap keyword (flash-attn < 2.6): cannot apply attention-logit softcapping"))
    if not _has_flex():
        status["flex"] = BackendStatus(False, "this torch build has no torch.nn.attention.flex_attention")
    else:
        status["flex"] = BackendStatus(
            True, "FlexAttention document (x image block) mask (compiled on first use; forward only on CPU: no "
            "CPU backward)", True, True,
        )
    status["sdpa_segments"] = BackendStatus(
        True, "exact per-segment SDPA (one host sync per call; image blocks via a per-segment mask; inside "
        "torch.compile: one SDPA over the row with a segment mask, no host sync)", True, True,
    )
    return status


def select_backend(device: torch.device | str, dtype: torch.dtype, *, image_blocks: bool = False,
                   softcap: bool = False) -> str:
    """The backend ``"auto"`` resolves to for tensors on ``device`` with ``dtype``.

    CUDA with fp16/bf16: flash_attn > torch_varlen > transformer_engine (the first available); everything
    else (CPU, fp32, no CUDA kernel installed): the exact per-segment SDPA path. With ``image_blocks`` (a rule
    the varlen kernels cannot express): FlexAttention on CUDA when available, else the per-segment SDPA path.
    With ``softcap`` (attention-logit softcapping): only backends that apply it (``BackendStatus.softcap``), so on
    CUDA flash_attn (>= 2.6) > flex.
    """
    device = torch.device(device)
    cuda_flex = device.type == "cuda" and available_backends()["flex"].available
    if image_blocks:
        return "flex" if cuda_flex else "sdpa_segments"
    if device.type == "cuda" and dtype in _HALF_DTYPES:
        status = available_backends()
        for name in _CUDA_PREFERENCE:
            if status[name].available and (status[name].softcap or not softcap):
                return name
        if softcap and cuda_flex:
            return "flex"
    return "sdpa_segments"


@lru_cache(maxsize=64)
def _auto_backend(device_type: str, dtype: torch.dtype, image_blocks: bool = False, softcap: bool = False) -> str:
    """Cached ``select_backend`` (probing imports on every layer call would be wasteful)."""
    return select_backend(device_type, dtype, image_blocks=image_blocks, softcap=softcap)


@torch.compiler.assume_constant_result  # under torch.compile: resolved eagerly, once, never traced
def _resolve_auto(device_type: str, dtype: torch.dtype, image_blocks: bool, softcap: bool = False) -> str:
    """What ``backend="auto"`` runs for these tensors (cached per device type, dtype and rule)."""
    return _auto_backend(device_type, dtype, image_blocks, softcap)


def _check_window(window: tuple[int, int] | None) -> None:
    """``window`` is None or ``(left, right)`` with ``-1`` meaning unbounded."""
    if window is not None and (len(window) != 2 or any(int(w) < -1 for w in window)):
        raise ValueError(f"window must be (left, right) with -1 meaning unbounded; got {window!r}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  window: tuple[int, int] | None) -> None:
    """Shape checks that need no device sync."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention takes THD tensors [T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}. Flatten a [1, T, H, D] packed row with .squeeze(0)."
        )
    if k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"k and v must share [T, H] and q, k the head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}) for grouped-query "
            "attention"
        )
    if cu_q.dim() != 1 or cu_k.dim() != 1 or cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must be 1-D with the same number of entries [N+1]; got "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}. Trim -1 sentinels / a leading batch dim first."
        )
    _check_window(window)


def _effective_window(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """(left, right) bounds with -1 = unbounded; causal forces right = 0 (flash-attn semantics)."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    return left, 0 if causal else right


def _host_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """Both cu_seqlens on the host with ONE device sync, validated against the token counts."""
    if cu_q is cu_k:
        host = np.asarray(cu_q.tolist(), dtype=np.int64)
        offs_q = offs_k = host
    else:
        both = np.asarray(torch.stack([cu_q.to(torch.int64), cu_k.to(torch.int64)]).tolist(), dtype=np.int64)
        offs_q, offs_k = both[0], both[1]
    for name, offs, total in (("cu_seqlens_q", offs_q, tq), ("cu_seqlens_k", offs_k, tk)):
        if offs.size == 0 or offs[0] != 0 or np.any(np.diff(offs) < 0):
            raise ValueError(f"{name} must start at 0 and be non-decreasing; got {offs.tolist()}")
        if offs[-1] != total:
            raise ValueError(
                f"{name}[-1] = {int(offs[-1])} but the tensor holds {total} tokens: pass the PHYSICAL boundaries "
                "(PackedBatch.cu_seqlens_padded, ending at T), not the logical cu_seqlens"
            )
    return offs_q, offs_k


def _segment_mask(lq: int, lk: int, left: int, right: int, device: torch.device,
                  blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[Lq, Lk]`` mask of allowed (query, key) pairs, bottom-right aligned.

    ``blocks`` (``[n, L]`` image-block ids of ``n`` self-attention segments, ``-1`` outside blocks) lifts the
    right bound for pairs inside one block; the mask is then ``[n, 1, L, L]``.
    """
    qpos = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    kpos = torch.arange(lk, device=device).unsqueeze(0)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= kpos <= qpos + right
    if blocks is not None:
        same_block = (blocks.unsqueeze(2) == blocks.unsqueeze(1)) & (blocks >= 0).unsqueeze(2)
        allowed = (allowed | same_block).unsqueeze(1)
    if left >= 0:
        allowed &= kpos >= qpos - left
    return allowed


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          is_causal: bool = False, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``[..., H, L, D]`` (grouped-query heads allowed); with ``softcap`` its
    math written out, the scores capped to ``softcap * tanh(score / softcap)`` before the mask, softmax in fp32 (as
    transformers' eager Gemma 2 attention): SDPA has no hook for the scores."""
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def _sdpa_group(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, left: int, right: int,
                scale: float | None, blocks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """SDPA over ``n`` equal-length segments batched as ``[n, H, L, D]``; returns ``[n, H, Lq, Dv]``.

    ``blocks``: ``[n, L]`` image-block ids (self-attention segments only), see ``_segment_mask``.
    """
    lq, lk = qg.shape[2], kg.shape[2]
    if blocks is not None:  # the diagonal is always allowed, so no row is empty
        allowed = _segment_mask(lq, lk, left, right, qg.device, blocks)
        return sdpa(qg, kg, vg, allowed, scale=scale, softcap=softcap)
    if left < 0 and right < 0:
        return sdpa(qg, kg, vg, scale=scale, softcap=softcap)
    if left < 0 and right == 0 and lq == lk:
        return sdpa(qg, kg, vg, is_causal=True, scale=scale, softcap=softcap)
    allowed = _segment_mask(lq, lk, left, right, qg.device)
    has_key = allowed.any(dim=1, keepdim=True)
    # Rows with no key would give NaN (and NaN grads); let them attend anywhere, then zero their output.
    out = sdpa(qg, kg, vg, allowed | ~has_key, scale=scale, softcap=softcap)
    return out * has_key.to(out.dtype).view(1, 1, lq, 1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None, window: tuple[int, int] | None = None,
                    block_ids: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Unpacked ``[B, H, S, D]`` attention (one sequence per row) with ``varlen_attention``'s semantics.

    Causal masking is bottom-right aligned, so a query chunk attending to a longer cached key range is right.
    ``block_ids`` (``[B, S]``, causal self-attention only): image blocks, see the module docstring.
    """
    _check_window(window)
    left, right = _effective_window(causal, window)
    if block_ids is not None:
        _check_blocks(block_ids, q.shape[0] * q.shape[2], k.shape[2], q.shape[2], causal)
        block_ids = block_ids.reshape(q.shape[0], q.shape[2])
    return _sdpa_group(q, k, v, left, right, softmax_scale, block_ids, softcap)


def _check_blocks(block_ids: torch.Tensor, tokens: int, tk: int, tq: int, causal: bool) -> None:
    """Image blocks need causal self-attention (queries and keys on the same slots) and one id per token."""
    if not causal or tq != tk:
        raise ValueError(
            "block_ids (bidirectional image blocks) need causal self-attention with as many keys as queries; got "
            f"causal={causal}, {tq} queries, {tk} keys (a KV cache longer than the query is not supported)"
        )
    if block_ids.numel() != tokens:
        raise ValueError(f"block_ids must hold one id per query token ({tokens}); got shape {tuple(block_ids.shape)}")


def _segments_with_blocks(block_ids: torch.Tensor, cu_q: torch.Tensor, offs_q: np.ndarray) -> np.ndarray:
    """Per segment: 1 if it holds an image-block token (one host read of ``N`` flags)."""
    n_seg = offs_q.size - 1
    seg = segment_ids(cu_q.to(torch.int64), block_ids.numel())
    counts = torch.zeros(n_seg + 1, dtype=torch.int64, device=block_ids.device)
    counts.index_add_(0, seg, (block_ids >= 0).to(torch.int64))
    return (np.asarray(counts[:n_seg].tolist(), dtype=np.int64) > 0).astype(np.int64)


def _sdpa_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   causal: bool, scale: float | None, window: tuple[int, int] | None,
                   block_ids: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Exact per-segment SDPA: segments of equal (Lq, Lk) are batched into one SDPA call.

    Cost is one host sync (reading cu_seqlens) and two host-to-device index copies per call, never one per
    segment; attention work is ``sum(Lq_i * Lk_i)`` (a block-diagonal dense mask would pay ``Tq * Tk``).
    With ``block_ids``, segments holding an image get a small per-segment ``[L, L]`` mask (one more host read);
    the others keep the mask-free causal kernel.
    """
    left, right = _effective_window(causal, window)
    offs_q, offs_k = _host_offsets(cu_q, cu_k, q.shape[0], k.shape[0])
    len_q, len_k = np.diff(offs_q), np.diff(offs_k)
    work = np.flatnonzero((len_q > 0) & (len_k > 0))
    if work.size == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    masked = np.zeros(len_q.size, dtype=np.int64) if block_ids is None else _segments_with_blocks(block_ids, cu_q, offs_q)
    keys = (len_q[work] * (int(len_k.max()) + 1) + len_k[work]) * 2 + masked[work]
    _, group_of = np.unique(keys, return_inverse=True)
    order = np.argsort(group_of, kind="stable")
    groups = np.split(work[order], np.flatnonzero(np.diff(group_of[order])) + 1)

    # Token indices of every group, concatenated: one host-to-device copy for q, one for k.
    idx_q = np.concatenate([(offs_q[g][:, None] + np.arange(len_q[g[0]])).ravel() for g in groups])
    idx_k = np.concatenate([(offs_k[g][:, None] + np.arange(len_k[g[0]])).ravel() for g in groups])
    dev_q = torch.from_numpy(idx_q).to(q.device, non_blocking=True)
    dev_k = torch.from_numpy(idx_k).to(q.device, non_blocking=True)

    pieces, start_q, start_k = [], 0, 0
    for g in groups:
        n, lq, lk = len(g), int(len_q[g[0]]), int(len_k[g[0]])
        blocks = None
        if n == 1:  # a lone segment is a view: no gather copy
            sq, sk = int(offs_q[g[0]]), int(offs_k[g[0]])
            qs, ks, vs = q.narrow(0, sq, lq), k.narrow(0, sk, lk), v.narrow(0, sk, lk)
            if masked[g[0]]:
                blocks = block_ids.narrow(0, sq, lq).view(1, lq)
        else:
            iq, ik = dev_q[start_q:start_q + n * lq], dev_k[start_k:start_k + n * lk]
            qs, ks, vs = q.index_select(0, iq), k.index_select(0, ik), v.index_select(0, ik)
            if masked[g[0]]:
                blocks = block_ids.index_select(0, iq).view(n, lq)
        qg = qs.reshape(n, lq, q.shape[1], q.shape[2]).transpose(1, 2)
        kg = ks.reshape(n, lk, k.shape[1], k.shape[2]).transpose(1, 2)
        vg = vs.reshape(n, lk, v.shape[1], v.shape[2]).transpose(1, 2)
        out = _sdpa_group(qg, kg, vg, left, right, scale, blocks, softcap)
        pieces.append(out.transpose(1, 2).reshape(n * lq, q.shape[1], v.shape[-1]))
        start_q, start_k = start_q + n * lq, start_k + n * lk

    if len(groups) == 1 and len(groups[0]) == 1 and len_q[groups[0][0]] == q.shape[0]:
        return pieces[0]
    # SDPA's output dtype, not q's: under autocast fp32 inputs give bf16/fp16 outputs.
    out = pieces[0].new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return out.index_put((dev_q,), torch.cat(pieces))


def _token_coordinates(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int) -> tuple[torch.Tensor, ...]:
    """Per token: segment and position inside it (queries in key coordinates: bottom-right alignment); keys past
    the last boundary get segment -1 (they match no query). On device, no host sync, shapes fixed by T."""
    same = cu_q is cu_k
    cu_q = cu_q.to(torch.int64)
    cu_k = cu_q if same else cu_k.to(torch.int64)
    n_seg = cu_q.numel() - 1
    seg_q, seg_k = segment_ids(cu_q, tq), segment_ids(cu_k, tk)
    pos_q = torch.arange(tq, device=cu_q.device) - cu_q[seg_q]
    if cu_q is not cu_k:  # cross lengths: bottom-right alignment shifts queries (self-attention: no shift)
        pos_q = pos_q + torch.cat([cu_k.diff() - cu_q.diff(), cu_k.new_zeros(1)])[seg_q]
    pos_k = torch.arange(tk, device=cu_k.device) - cu_k[seg_k]
    return seg_q, torch.where(seg_k == n_seg, -1, seg_k), pos_q, pos_k


def _allowed(seg_q, seg_k, pos_q, pos_k, qi, ki, left: int, right: int, block_ids: torch.Tensor | None):
    """The (query ``qi``, key ``ki``) rule of the module docstring, on token coordinates."""
    allowed = seg_q[qi] == seg_k[ki]
    if right >= 0:
        forward_ok = pos_k[ki] <= pos_q[qi] + right
        if block_ids is not None:
            forward_ok = forward_ok | ((block_ids[qi] == block_ids[ki]) & (block_ids[qi] >= 0))
        allowed = allowed & forward_ok
    if left >= 0:
        allowed = allowed & (pos_k[ki] >= pos_q[qi] - left)
    return allowed


def _sdpa_row_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   causal: bool, scale: float | None, window: tuple[int, int] | None,
                   block_ids: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Exact SDPA over the whole row with a ``[Tq, Tk]`` segment mask built on device: the path inside
    ``torch.compile`` (no host sync, no numpy, every shape fixed by ``T``: a fixed-width row never recompiles).
    Costs ``Tq * Tk`` instead of ``sum(Lq_i * Lk_i)``."""
    left, right = _effective_window(causal, window)
    seg_q, seg_k, pos_q, pos_k = _token_coordinates(cu_q, cu_k, q.shape[0], k.shape[0])
    qi = torch.arange(q.shape[0], device=q.device)[:, None]
    ki = torch.arange(k.shape[0], device=q.device)[None]
    allowed = _allowed(seg_q, seg_k, pos_q, pos_k, qi, ki, left, right, block_ids)
    has_key = allowed.any(dim=1, keepdim=True)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # THD -> [1, H, T, D]
    out = sdpa(q4, k4, v4, allowed | ~has_key, scale=scale, softcap=softcap)
    return (out * has_key.to(out.dtype)).squeeze(0).transpose(0, 1)


def document_block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int, *, causal: bool,
                        window: tuple[int, int] | None = None, block_size: int = _FLEX_BLOCK,
                        block_ids: torch.Tensor | None = None) -> "torch.nn.attention.flex_attention.BlockMask":
    """FlexAttention ``BlockMask`` for a packed row, built from block-level segment ranges (no ``T x T`` eval).

    Blocks where every (query, key) pair is allowed are marked full (no ``mask_mod`` call); blocks that may hold
    an allowed pair are partial; all others are skipped. All on device, no host sync. ``block_ids`` (``[T]``,
    causal self-attention): documents x image blocks, see the module docstring.
    """
    from torch.nn.attention.flex_attention import BlockMask

    left, right = _effective_window(causal, window)
    n_seg = cu_q.numel() - 1
    seg_q, seg_k, pos_q, pos_k = _token_coordinates(cu_q, cu_k, tq, tk)

    def mask_mod(b, h, qi, ki):
        return _allowed(seg_q, seg_k, pos_q, pos_k, qi, ki, left, right, block_ids)

    def block_stats(x: torch.Tensor, total: int, fill_lo: int, fill_hi: int):
        """Per-block (min, max) of ``x``, padding the last block with values that never widen the range."""
        n_blocks = -(-total // block_size)
        pad = n_blocks * block_size - total
        lo = F.pad(x, (0, pad), value=fill_lo).view(n_blocks, block_size)
        hi = F.pad(x, (0, pad), value=fill_hi).view(n_blocks, block_size)
        return hi.amin(1), lo.amax(1), pad

    big = max(tq, tk) + n_seg + 2
    sq_min, sq_max, _ = block_stats(seg_q, tq, -big, big)
    sk_min, sk_max, pad_k = block_stats(seg_k, tk, -big, big)
    pq_min, pq_max, _ = block_stats(pos_q, tq, -big, big)
    pk_min, pk_max, _ = block_stats(pos_k, tk, -big, big)
    col = (slice(None), None)
    row = (None, slice(None))
    maybe = (sq_min[col] <= sk_max[row]) & (sk_min[row] <= sq_max[col])
    full = (sq_min[col] == sq_max[col]) & (sk_min[row] == sk_max[row]) & (sq_min[col] == sk_min[row])
    full &= sq_min[col] < n_seg
    if pad_k:  # the padded tail of the last key block is masked, so that block cannot be full
        full[:, -1] = False
    if right >= 0:
        forward_maybe = pk_min[row] <= pq_max[col] + right
        if block_ids is not None:  # a key block after the diagonal may share an image with the query block
            image = block_ids >= 0  # text tokens get values that never widen a block's id range
            b_min = block_stats(torch.where(image, block_ids, big), tq, big, big)[0]
            b_max = block_stats(torch.where(image, block_ids, -big), tq, -big, -big)[1]
            forward_maybe |= (b_min[col] <= b_max[row]) & (b_min[row] <= b_max[col])
        maybe &= forward_maybe
        full &= pk_max[row] <= pq_min[col] + right
    if left >= 0:
        maybe &= pk_max[row] >= pq_min[col] - left
        full &= pk_min[row] >= pq_max[col] - left
    partial = maybe & ~full

    def to_blocks(m: torch.Tensor):
        order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)
        return m.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_idx = to_blocks(partial)
    full_num, full_idx = to_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(tq, tk))


@lru_cache(maxsize=4)
def _compiled_flex(device_type: str) -> Callable:
    """``torch.compile(flex_attention)``, built once per device type (eager flex materialises T x T scores).

    Dynamic shapes on CUDA; static on CPU, where inductor's CPU flex template fails to compile dynamic shapes
    (torch 2.14: "cur_qSplitSize1 was not declared"), so each new row length recompiles there.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=device_type != "cpu")


def _flex_kernel(device_type: str) -> Callable:
    """The flex entry point: compiled, unless we are already inside a compiled region."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    return _compiled_flex(device_type)


# Plans derived from the boundaries of the batch in flight: every layer of one forward gets the same cu tensors.
_plans: tuple[weakref.ref, weakref.ref, int, int, dict] | None = None


def _batch_plans(cu_q: torch.Tensor, cu_k: torch.Tensor) -> dict:
    """The plan dict of these boundary tensors (a new batch, or boundaries changed in place, starts a new one):
    FlexAttention's block mask is built once per batch and layer kind, not once per layer."""
    global _plans
    if (_plans is not None and _plans[0]() is cu_q and _plans[1]() is cu_k
            and _plans[2:4] == (cu_q._version, cu_k._version)):
        return _plans[4]
    _plans = (weakref.ref(cu_q), weakref.ref(cu_k), cu_q._version, cu_k._version, {})
    return _plans[4]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
          causal: bool, scale: float | None, window: tuple[int, int] | None,
          block_ids: torch.Tensor | None = None, plan_cache: dict | None = None,
          softcap: float | None = None) -> torch.Tensor:
    """FlexAttention with a document (x image block) mask built from cu_seqlens (forward only on CPU); ``softcap``:
    a ``score_mod`` capping each scaled score.

    ``plan_cache``: a dict owned by the caller for one batch (default: one kept per boundary tensors); the block
    mask is built once per (rule, window) and reused by every later layer of that batch.
    """
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(
            "backend='flex' has no backward on CPU in this torch build; use backend='sdpa_segments' for "
            "CPU training (or run flex under torch.no_grad())"
        )
    if plan_cache is None and not torch.compiler.is_compiling():
        plan_cache = _batch_plans(cu_q, cu_k)
    key = ("flex", q.shape[0], k.shape[0], causal, window, block_ids is not None)
    block_mask = None if plan_cache is None else plan_cache.get(key)
    if block_mask is None:
        block_mask = document_block_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal=causal, window=window,
                                         block_ids=block_ids)
        if plan_cache is not None:
            plan_cache[key] = block_mask
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # THD -> [1, H, T, D]
    capped = {} if softcap is None else {"score_mod": _capped_score(float(softcap))}
    out = _flex_kernel(q.device.type)(q4, k4, v4, block_mask=block_mask, scale=scale,
                                      enable_gqa=q.shape[1] != k.shape[1], **capped)
    return out.squeeze(0).transpose(0, 1)


@lru_cache(maxsize=8)
def _capped_score(softcap: float) -> Callable:
    """FlexAttention ``score_mod`` of attention-logit softcapping (one per value, so compiled flex is reused)."""

    def score_mod(score, batch, head, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _require_half(name: str, q: torch.Tensor) -> None:
    if q.dtype not in _HALF_DTYPES:
        raise ValueError(f"backend={name!r} needs fp16/bf16 tensors, got {q.dtype}; cast q/k/v or use "
                         "backend='sdpa_segments'")


def _flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap=None) -> torch.Tensor:
    """flash_attn_varlen_func (GQA native; fp16/bf16, one head dim for q, k and v; ``softcap`` from 2.6)."""
    from flash_attn import flash_attn_varlen_func

    _require_half("flash_attn", q)
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"backend='flash_attn' needs the value head dim ({v.shape[-1]}) equal to the query/key "
                         f"head dim ({q.shape[-1]}); use backend='sdpa_segments' (or 'flex')")
    return flash_attn_varlen_func(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                  dropout_p=0.0, softmax_scale=scale, causal=causal,
                                  window_size=_effective_window(causal, window),
                                  deterministic=torch.are_deterministic_algorithms_enabled(),
                                  **({} if softcap is None else {"softcap": float(softcap)}))


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn (FlashAttention-2 / cuDNN inside torch; fp16/bf16, CUDA).

    Grouped-query attention: ``enable_gqa`` where this torch has it (2.12+); on torch 2.11 the key/value heads are
    repeated to the query heads (query head ``h`` reads KV head ``h // group``, as ``repeat_interleave`` lays out).
    """
    from torch.nn.attention.varlen import varlen_attn

    _require_half("torch_varlen", q)
    gqa = q.shape[1] != k.shape[1]
    keywords = {"scale": scale, "window_size": _effective_window(causal, window)}
    if _torch_varlen_gqa():
        keywords["enable_gqa"] = gqa
    elif gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **keywords)


@lru_cache(maxsize=32)
def _te_module(num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None):
    """A parameter-free TransformerEngine DotProductAttention for THD inputs (cached per shape)."""
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention(num_heads, head_dim, num_gqa_groups=num_kv_heads, attention_dropout=0.0,
                               qkv_format="thd", softmax_scale=scale)


def _te_window(causal: bool, window: tuple[int, int] | None, max_len: int) -> tuple[str, tuple[int, int]]:
    """(mask type, window) in TransformerEngine's terms. TE takes causal masks with ``(left, 0)`` windows and
    padding masks with ``(-1, -1)`` or ``(>= 0, >= 0)``: it asserts on ``(l, -1)`` / ``(-1, r)`` and rewrites a
    non-causal ``(-1, 0)`` to full attention. A right bound of 0 is causal; an unbounded side is bounded by the
    longest segment (no key of a segment is further away), so every window keeps its meaning."""
    left, right = _effective_window(causal, window)
    if right == 0:
        return "padding_causal_bottom_right", (left, 0)
    if (left < 0) != (right < 0):
        left, right = (max_len if left < 0 else left), (max_len if right < 0 else right)
    return "padding", (left, right)


def _transformer_engine(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window) -> torch.Tensor:
    """TransformerEngine fused attention, THD format (thin wrapper; TE picks its own kernel)."""
    if q.shape[-1] != v.shape[-1]:
        raise ValueError(f"backend='transformer_engine' wrapper needs the value head dim ({v.shape[-1]}) equal to "
                         f"the query/key head dim ({q.shape[-1]}); use backend='sdpa_segments' (or 'flex')")
    mask_type, window_size = _te_window(causal, window, max(max_q, max_k))
    module = _te_module(q.shape[1], q.shape[2], k.shape[1], scale)
    out = module(q, k, v, qkv_format="thd", cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=cu_k.to(torch.int32),
                 max_seqlen_q=max_q, max_seqlen_kv=max_k, attn_mask_type=mask_type, window_size=window_size)
    return out.view(q.shape[0], q.shape[1], v.shape[-1])


def _max_len(value: int | torch.Tensor | None, cu: torch.Tensor) -> int:
    """A longest-segment length as a Python int for the kernels (derived from ``cu`` when None; one sync)."""
    return int(cu.diff().max()) if value is None else int(value)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None, max_seqlen_k: int | None, *,
                     causal: bool = True,
                     softmax_scale: float | None = None, window: tuple[int, int] | None = None,
                     backend: str = "auto", block_ids: torch.Tensor | None = None,
                     plan_cache: dict | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention over a packed THD row, never across a ``cu_seqlens`` boundary; returns ``[Tq, Hq, Dv]``.

    ``cu_seqlens_*`` are the PHYSICAL boundaries and end at ``T`` (the host paths check it; GPU kernels trust
    it). ``max_seqlen_*`` should be Python ints (a tensor costs a device sync; None: derived from the boundaries
    by the CUDA kernels that need it, never read by the CPU paths, so ``torch.compile`` does not specialize on it). ``backend="auto"`` uses
    ``select_backend``; name one of ``BACKENDS`` to force it (``available_backends()`` says what runs here).
    ``block_ids`` (``[T]`` int, ``-1`` outside images; causal self-attention with ``cu_seqlens_q`` equal to
    ``cu_seqlens_k``): tokens of one image block also see each other both ways (module docstring).
    ``plan_cache``: optional dict, one per batch, in which a backend keeps what it derives from the boundaries
    (FlexAttention's block mask) for the next layer of the same batch. ``softcap``: attention-logit softcapping
    (module docstring); a backend that cannot apply it is refused by name (``BackendStatus.softcap``).
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, window)
    if block_ids is not None:
        _check_blocks(block_ids, q.shape[0], k.shape[0], q.shape[0], causal)
        block_ids = block_ids.reshape(-1)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to attend to: every row outputs 0
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    name = (_resolve_auto(q.device.type, q.dtype, block_ids is not None, softcap is not None) if backend == "auto"
            else backend)
    if name == "sdpa_segments" and torch.compiler.is_compiling():
        return _sdpa_row_mask(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window, block_ids, softcap)
    if name == "sdpa_segments":
        return _sdpa_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window, block_ids, softcap)
    if name == "flex":
        return _flex(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window, block_ids, plan_cache,
                     softcap)
    kernels = {"flash_attn": _flash_attn, "torch_varlen": _torch_varlen, "transformer_engine": _transformer_engine}
    if name not in kernels:
        raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {BACKENDS}")
    status = available_backends()[name]
    if softcap is not None and not status.softcap:  # torch_varlen / TE: no score hook; flash-attn before 2.6
        raise ValueError(
            f"backend {name!r} cannot apply attention-logit softcapping (softcap={softcap}, Gemma 2 / PaliGemma 2): "
            f"its kernel takes no softcap ({status.reason}). Use backend='auto', 'flash_attn' (flash-attn >= 2.6), "
            "'flex' or 'sdpa_segments' (see available_backends()[name].softcap)"
        )
    if block_ids is not None:
        raise ValueError(
            f"backend {name!r} cannot express bidirectional image blocks (block_ids): its mask is a causal band per "
            "segment. Use backend='auto', 'flex' or 'sdpa_segments' (see available_backends()[name].image_blocks)"
        )
    if not status.available:
        raise RuntimeError(f"attention backend {name!r} is not available here: {status.reason}")
    extra = {} if softcap is None else {"softcap": softcap}
    return kernels[name](q, k, v, cu_seqlens_q, cu_seqlens_k, _max_len(max_seqlen_q, cu_seqlens_q),
                         _max_len(max_seqlen_k, cu_seqlens_k), causal,
                         softmax_scale, window, **extra)
