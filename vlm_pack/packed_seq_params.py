"""Megatron-style THD metadata (``PackedSeqParams``) from a packed batch.

Accepts a :class:`~vlm_pack.packing.PackedBatch` or a dict batch from the offline path, where ``cu_seqlens``
may arrive as ``[1, N]`` right-padded with ``-1`` sentinels (fixed shapes for collation / CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .packing import PackedBatch

__all__ = ["PackedSeqParams", "get_packed_seq_params", "trim_cu_seqlens", "seq_idx_from_cu_seqlens"]


@dataclass
class PackedSeqParams:
    """Boundaries of a THD-packed row, named as Megatron-Core / TransformerEngine expect them.

    ``cu_seqlens_q/kv`` are the boundaries attention uses. When sequences were padded for alignment, they hold
    the real (unpadded) boundaries and ``*_padded`` the physical ones; otherwise ``*_padded`` stay ``None``
    (TransformerEngine picks a slower kernel when they are set needlessly).
    """

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    max_seqlen_q: int | torch.Tensor | None
    max_seqlen_kv: int | torch.Tensor | None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None


def trim_cu_seqlens(cu_seqlens: torch.Tensor, argmin: torch.Tensor | int | None = None) -> torch.Tensor:
    """Flatten ``[1, N]`` boundaries and cut ``-1`` sentinels: at ``argmin`` when given, else at the first -1."""
    flat = cu_seqlens.reshape(-1)
    if argmin is not None:
        return flat[: int(argmin)]
    sentinel = (flat == -1).nonzero()
    return flat[: int(sentinel[0])] if sentinel.numel() else flat


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Segment id of every token: ``[0, 5, 7, 11]`` with 16 tokens -> ``[0]*5 + [1]*2 + [2]*4 + [3]*5``."""
    bounds = cu_seqlens.long()
    end = bounds.new_full((1,), total_tokens)
    if bounds[-1] < total_tokens:
        bounds = torch.cat([bounds, end])
    lengths = bounds.diff()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=bounds.device), lengths, output_size=total_tokens)


def get_packed_seq_params(batch: PackedBatch | Mapping[str, Any], total_tokens: int | None = None) -> PackedSeqParams:
    """Build :class:`PackedSeqParams` (``qkv_format="thd"``) from a packed batch.

    Dict keys read: ``cu_seqlens`` (+ ``cu_seqlens_argmin``), optional ``cu_seqlens_unpadded``
    (+ ``cu_seqlens_unpadded_argmin``), ``max_seqlen``, and ``total_tokens`` or ``tokens`` for ``seq_idx``.
    For a ``PackedBatch``, ``cu_seqlens`` is the unpadded variant whenever it differs from the physical one.
    """
    if isinstance(batch, PackedBatch):
        physical = batch.cu_seqlens_padded
        unpadded = None if torch.equal(batch.cu_seqlens, physical) else batch.cu_seqlens
        max_seqlen: int | torch.Tensor | None = batch.max_seqlen
        tokens = batch.tokens
        total_tokens = total_tokens if total_tokens is not None else tokens.shape[-1]
    else:
        if "cu_seqlens" not in batch:
            raise ValueError("batch has no 'cu_seqlens'; pack it first (pack_batch_sequences or PackedSFTDataset)")
        physical = trim_cu_seqlens(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"))
        unpadded = None
        if batch.get("cu_seqlens_unpadded") is not None:
            unpadded = trim_cu_seqlens(batch["cu_seqlens_unpadded"], batch.get("cu_seqlens_unpadded_argmin"))
        max_seqlen = batch.get("max_seqlen")
        if isinstance(max_seqlen, torch.Tensor) and max_seqlen.numel() == 1:
            max_seqlen = int(max_seqlen)
        if total_tokens is None:
            total_tokens = batch.get("total_tokens")
            if total_tokens is None and batch.get("tokens") is not None:
                total_tokens = batch["tokens"].shape[-1]
        total_tokens = None if total_tokens is None else int(total_tokens)

    physical = physical.to(torch.int32)
    seq_idx = None if total_tokens is None else seq_idx_from_cu_seqlens(physical, total_tokens)
    if unpadded is not None:
        unpadded = unpadded.to(torch.int32)
        q, q_padded = unpadded, physical
    else:
        q, q_padded = physical, None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=q,
        cu_seqlens_kv=q,
        cu_seqlens_q_padded=q_padded,
        cu_seqlens_kv_padded=q_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        total_tokens=total_tokens,
        seq_idx=seq_idx,
    )
