"""Megatron-style THD metadata (``PackedSeqParams``) from a packed batch.

Accepts a :class:`~vlm_pack.core.packing.PackedBatch`, the dict of the in-batch collator, or a dict batch from the
offline path, where ``cu_seqlens`` may arrive as ``[1, N]`` right-padded with ``-1`` sentinels (fixed shapes for
collation / CUDA graphs). :func:`packed_boundaries` is the one place that knows where each path keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .batch import METADATA_KEY
from .packing import PackedBatch, segment_ids

__all__ = [
    "PackedSeqParams",
    "get_packed_seq_params",
    "packed_boundaries",
    "seq_idx_from_cu_seqlens",
    "trim_cu_seqlens",
]


@dataclass
class PackedSeqParams:
    """Boundaries of a THD-packed row, named as Megatron-Core / TransformerEngine expect them.

    ``cu_seqlens_q/kv`` are the boundaries attention uses. When sequences were padded for alignment, they hold
    the real (unpadded) boundaries and ``*_padded`` the physical ones; otherwise ``*_padded`` stay ``None``
    (TransformerEngine picks a slower kernel when they are set needlessly). ``seq_idx``: int32 ``[1, T]``, the
    segment of every token (what Megatron-Core's Mamba / linear-attention layers read). ``local_cp_size`` and
    ``cp_group`` are Megatron-Core's dynamic context-parallel fields (read by its attention; None: the model's
    own context-parallel group), so this class can be handed to Megatron-Core as it is.
    """

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    max_seqlen_q: int | None
    max_seqlen_kv: int | None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    local_cp_size: int | None = None
    cp_group: Any = None  # torch.distributed.ProcessGroup


def trim_cu_seqlens(cu_seqlens: torch.Tensor, argmin: torch.Tensor | int | None = None) -> torch.Tensor:
    """Flatten ``[1, N]`` boundaries and cut ``-1`` sentinels: at ``argmin`` when given, else at the first -1."""
    flat = cu_seqlens.reshape(-1)
    if argmin is not None:
        return flat[: int(argmin)]
    sentinel = (flat == -1).nonzero()
    return flat[: int(sentinel[0])] if sentinel.numel() else flat


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Segment id of every token, int32 ``[1, T]`` as Megatron-Core's ``PackedSeqParams.seq_idx`` is:
    ``[0, 5, 7, 11]`` with 16 tokens -> ``[[0]*5 + [1]*2 + [2]*4 + [3]*5]``.

    Tokens past ``cu_seqlens[-1]`` form one more segment. No host sync (``vlm_pack.core.packing.segment_ids``).
    """
    return segment_ids(cu_seqlens, int(total_tokens)).to(torch.int32).unsqueeze(0)


def _fields(batch: PackedBatch | Mapping[str, Any]) -> Mapping[str, Any]:
    """A flat view: a ``PackedBatch``'s fields, or a batch dict with its ``batch["vlm_pack"]`` metadata lifted up."""
    if isinstance(batch, PackedBatch):
        return batch.to_dict()
    if isinstance(batch.get(METADATA_KEY), Mapping):
        return {**batch, **batch[METADATA_KEY]}
    return batch


def packed_boundaries(batch: PackedBatch | Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(physical, real)`` boundaries of a packed batch, flat, ``-1`` sentinels trimmed; ``real`` may be None.

    Reads both conventions of the library:

    * in-batch packing (``PackedBatch`` or its dict, ``VLMPackingCollator`` output, whose bookkeeping sits in
      ``batch["vlm_pack"]``): ``cu_seqlens_padded`` is physical and ``cu_seqlens`` real; ``real`` is None when
      the two are equal (no alignment slots, no fill);
    * offline packing (``PackedSFTDataset``, in ``batch["vlm_pack"]``): ``cu_seqlens`` ``[1, K]`` is physical
      (valid up to ``cu_seqlens_argmin``), ``cu_seqlens_unpadded`` (+ argmin), when present, real;
    * a bare Hugging Face batch (``PackedDataset.collate``): ``cu_seq_lens_q``, physical.
    """
    batch = _fields(batch)
    if batch.get("cu_seqlens_padded") is not None:
        physical = batch["cu_seqlens_padded"].reshape(-1)  # in-batch boundaries carry no sentinels
        real = batch.get("cu_seqlens")
        real = None if real is None else real.reshape(-1)
        if real is not None and real.shape == physical.shape and torch.equal(real, physical):
            real = None
        return physical, real
    for key in ("cu_seqlens", "cu_seq_lens_q"):
        if batch.get(key) is not None:
            physical = trim_cu_seqlens(batch[key], batch.get("cu_seqlens_argmin"))
            real = batch.get("cu_seqlens_unpadded")
            if real is not None:
                real = trim_cu_seqlens(real, batch.get("cu_seqlens_unpadded_argmin"))
            return physical, real
    raise ValueError(
        "batch has none of cu_seqlens_padded / cu_seqlens / cu_seq_lens_q: cannot find the packed sequence "
        "boundaries; pack it first (pack_batch_sequences, VLMPackingCollator or PackedSFTDataset)"
    )


def get_packed_seq_params(batch: PackedBatch | Mapping[str, Any], total_tokens: int | None = None) -> PackedSeqParams:
    """Build :class:`PackedSeqParams` (``qkv_format="thd"``) from a packed batch (see :func:`packed_boundaries`).

    ``max_seqlen`` is read from ``max_seqlen`` (or the Hugging Face ``max_length_q``); ``total_tokens`` (for
    ``seq_idx``) from the argument, ``total_tokens``, or the width of ``tokens`` / ``input_ids``.
    """
    physical, unpadded = packed_boundaries(batch)
    batch = _fields(batch)
    max_seqlen = _single_max_seqlen(batch.get("max_seqlen", batch.get("max_length_q")))
    if total_tokens is None:
        total_tokens = batch.get("total_tokens")
    if total_tokens is None:
        tokens = batch.get("tokens", batch.get("input_ids"))
        total_tokens = None if tokens is None else tokens.shape[-1]
    total_tokens = None if total_tokens is None else int(total_tokens)

    physical = physical.to(torch.int32)
    seq_idx = None if total_tokens is None else seq_idx_from_cu_seqlens(physical, total_tokens)
    if unpadded is not None:
        q, q_padded = unpadded.to(torch.int32), physical
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


def _single_max_seqlen(value: Any) -> int | None:
    """``max_seqlen`` as one int: a one-element tensor is read, several values (a batch of packs) are an error."""
    if value is None:
        return None
    values = torch.as_tensor(value)
    if values.numel() != 1:
        raise ValueError(
            f"max_seqlen has {values.numel()} elements (shape {tuple(values.shape)}); a packed row has ONE longest "
            "sequence. Collate one pack per micro-batch (micro_batch_size=1) or pass the max over the packs"
        )
    return int(values.reshape(()))
