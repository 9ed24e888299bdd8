"""Context parallelism on packed rows: the zigzag THD split, its inverse, and a K/V all-gather with autograd.

Each sequence (padded length ``L``, a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of ``L / (2 * cp)``;
rank ``r`` keeps chunk ``r`` and chunk ``2 * cp - 1 - r``, sequence by sequence. Pairing an early chunk with a
late one gives every rank the same share of causal-attention work. Example, ``cu_seqlens_padded=[0, 8, 16]``,
``cp=2``::

    global slot   0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15
    rank          0 0 1 1 1 1 0 0 | 0 0  1  1  1  1  0  0

The boundary metadata (``cu_seqlens*``, ``max_seqlen``) stays global: attention on a rank runs its local
queries against the all-gathered keys/values with the global boundaries (``context_parallel_all_gather``
rebuilds K/V in global order, and ``zigzag_indices`` gives each local query its global slot for the causal
mask).

Labels must be shifted to next-token targets on the GLOBAL row before partitioning
(``vlm_pack.core.loss.shift_packed_labels``): the next token of a chunk's last slot lives on another rank.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .batch import METADATA_KEY
from .packed_seq_params import packed_boundaries

__all__ = [
    "context_parallel_all_gather",
    "context_parallel_gather_index",
    "gather_from_context_parallel",
    "partition_for_context_parallel",
    "unpartition_context_parallel",
    "zigzag_indices",
]

BatchT = TypeVar("BatchT")

# Keys holding per-sequence metadata, never split even when their last dim happens to equal T.
_GLOBAL_KEYS = frozenset(
    {"cu_seqlens", "cu_seqlens_padded", "cu_seqlens_unpadded", "cu_seqlens_argmin", "seq_lengths", "max_seqlen"}
)


def _check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1; got {cp_size!r}")
    if cp_rank is not None and not (isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}); got {cp_rank!r}")


def _validated_boundaries(cu_seqlens_padded: torch.Tensor, cp_size: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens_padded`` as int64 ``[N + 1]`` plus the row width T, checked with ONE host sync.

    Every segment must be non-negative and, for ``cp_size > 1``, a multiple of ``2 * cp_size``.
    """
    if not isinstance(cu_seqlens_padded, torch.Tensor):
        raise ValueError(f"cu_seqlens_padded must be a torch.Tensor; got {type(cu_seqlens_padded).__name__}")
    if cu_seqlens_padded.dim() == 2 and cu_seqlens_padded.shape[0] == 1:
        cu_seqlens_padded = cu_seqlens_padded[0]
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() == 0:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D [N + 1] (or [1, N + 1]); got shape {tuple(cu_seqlens_padded.shape)}"
        )
    cu = cu_seqlens_padded.long()
    lengths = cu.diff()
    chunks = 2 * cp_size if cp_size > 1 else 1
    bad = (lengths < 0) | (lengths % chunks != 0)
    n = lengths.numel()
    candidates = torch.where(bad, torch.arange(n, device=cu.device), n)
    first_bad = torch.cat([candidates, cu.new_full((1,), n)]).amin().reshape(1)
    start, total, bad_index = torch.cat([cu[:1], cu[-1:], first_bad]).tolist()  # the one host sync
    if start != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0; got {start}")
    if bad_index < n:
        length = int(lengths[bad_index])
        if length < 0:
            raise ValueError(
                f"cu_seqlens_padded decreases at sequence {bad_index} (length {length}); it must be a cumsum"
            )
        raise ValueError(
            f"sequence {bad_index} has padded length {length}, not divisible by 2*cp = {chunks} (cp_size={cp_size}): "
            f"pack with pad_to_multiple_of=pad_multiple({cp_size}, tensor_parallel_size, sequence_parallel) "
            f"(a multiple of {chunks}); with pad_to_length, make that length a multiple of {chunks} too."
        )
    return cu, total


def zigzag_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global slots (int64 ``[T / cp]``, increasing) that rank ``cp_rank`` keeps under the zigzag split.

    The rank's block of the inverse of :func:`context_parallel_gather_index`, so the split is defined in one place.
    Vectorised over all sequences; one host sync (the validation, which also yields T).
    """
    _check_cp(cp_size, cp_rank)
    inverse = context_parallel_gather_index(cu_seqlens_padded, cp_size)
    total = inverse.numel()
    local = total // cp_size
    order = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(total, device=inverse.device))
    return order[cp_rank * local : (cp_rank + 1) * local]


def context_parallel_gather_index(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """For each global slot, its index in the rank-major concatenation ``cat(shard_0, ..., shard_{cp-1})``.

    Slot ``o`` of a sequence with chunk length ``c`` lies in chunk ``o // c``; rank ``r`` owns chunks ``r`` and
    ``2 * cp - 1 - r`` and keeps them in order, so inside every shard a sequence starts at ``cu / cp``.
    """
    cu, total = _validated_boundaries(cu_seqlens_padded, cp_size)
    device = cu.device
    if cp_size == 1:
        return torch.arange(total, device=device)
    chunks = 2 * cp_size
    lengths = cu.diff()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
    offset = torch.arange(total, device=device) - cu[:-1][seq]
    c = (lengths // chunks)[seq]
    chunk_id = offset // c
    late = chunk_id >= cp_size
    owner = torch.where(late, chunks - 1 - chunk_id, chunk_id)
    slot = cu[:-1][seq] // cp_size + late.long() * c + offset % c
    return owner * (total // cp_size) + slot


def gather_from_context_parallel(
    shards: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = -1
) -> torch.Tensor:
    """Inverse of the zigzag split: ``shards[r]`` is rank r's slice; returns the tensor in global slot order.

    Differentiable (a concatenation and an index_select).
    """
    if len(shards) == 0:
        raise ValueError("shards is empty: pass one tensor per context-parallel rank, in rank order")
    inverse = context_parallel_gather_index(cu_seqlens_padded, len(shards))
    joined = torch.cat(list(shards), dim=dim)
    if joined.shape[dim] != inverse.numel():
        raise ValueError(
            f"shards hold {joined.shape[dim]} slots along dim {dim} in total but cu_seqlens_padded covers "
            f"{inverse.numel()}: pass every rank's slice of the same packed row"
        )
    return joined.index_select(dim, inverse.to(joined.device))


def _batch_items(batch: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if isinstance(batch, Mapping):
        return dict(batch)
    raise ValueError(
        f"batch must be a PackedBatch (or another dataclass) or a dict of tensors; got {type(batch).__name__}"
    )


def _is_per_token(name: str, value: Any, total: int) -> bool:
    """A tensor is per-token when its last dim is T and it is ``[T]`` or has a batch dim of 1 before T."""
    if name in _GLOBAL_KEYS or name.startswith("cu_") or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return value.shape[-1] == total and (value.dim() == 1 or value.shape[-2] == 1)


def _rebuild(batch: BatchT, changes: dict[str, torch.Tensor]) -> BatchT:
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **changes)
    out = copy.copy(batch)
    if not isinstance(out, MutableMapping):
        raise ValueError(f"cannot write split tensors back into a {type(batch).__name__}; pass a dict")
    out.update(changes)
    return out


def partition_for_context_parallel(batch: BatchT, cp_size: int, cp_rank: int) -> BatchT:
    """Rank ``cp_rank``'s zigzag slice of a packed batch (same type and keys; boundary metadata stays global).

    Splits every per-token tensor along its last dim (``tokens``, ``labels``, ``loss_mask``, ``padding_mask``,
    ``position_ids`` incl. leading mRoPE channels ``[C, 1, T]``, and any dict key shaped ``[T]`` / ``[..., 1, T]``
    such as ``mm_token_type_ids``). Shift labels on the global row first (see module docstring).

    Args:
        batch: a :class:`~vlm_pack.core.packing.PackedBatch` or a collator batch (dict), padded to a multiple of
            ``2 * cp_size`` per sample.
        cp_size: context-parallel ranks.
        cp_rank: this rank.

    Returns:
        The same type with every per-token field cut to this rank's ``T / cp_size`` slots.
    """
    items = _batch_items(batch)
    cu, _ = packed_boundaries(items)
    index = zigzag_indices(cu, cp_size, cp_rank)
    total = index.numel() * cp_size
    for key in ("tokens", "input_ids"):
        value = items.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] != total:
            raise ValueError(
                f"{key} has {value.shape[-1]} slots but the boundaries end at {total}: every slot must belong to a "
                "segment (pack with pad_to_length so the trailing fill is its own segment)"
            )
    def split(group: Mapping[str, Any]) -> dict[str, Any]:
        return {
            name: value.index_select(-1, index.to(value.device))
            for name, value in group.items()
            if _is_per_token(name, value, total)
        }

    changes = split(items)
    if isinstance(items.get(METADATA_KEY), Mapping):  # per-token bookkeeping (e.g. Megatron's loss_mask)
        changes[METADATA_KEY] = {**items[METADATA_KEY], **split(items[METADATA_KEY])}
    return _rebuild(batch, changes)


def unpartition_context_parallel(shards: Sequence[BatchT]) -> BatchT:
    """Inverse of :func:`partition_for_context_parallel`: ``shards[r]`` is rank r's batch; returns the full batch."""
    if len(shards) == 0:
        raise ValueError("shards is empty: pass one partitioned batch per context-parallel rank, in rank order")
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    per_rank = [_batch_items(shard) for shard in shards]
    first = per_rank[0]
    cu, _ = packed_boundaries(first)
    _, total = _validated_boundaries(cu, cp_size)
    def join(groups: list[Mapping[str, Any]]) -> dict[str, Any]:
        return {
            name: gather_from_context_parallel([group[name] for group in groups], cu, dim=-1)
            for name, value in groups[0].items()
            if _is_per_token(name, value, total // cp_size)
        }

    changes = join(per_rank)
    if isinstance(first.get(METADATA_KEY), Mapping):
        changes[METADATA_KEY] = {**first[METADATA_KEY], **join([items[METADATA_KEY] for items in per_rank])}
    return _rebuild(shards[0], changes)


class _ContextParallelAllGather(torch.autograd.Function):
    """All-gather zigzag shards into global slot order; backward reduce-scatters the gradient back."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, inverse: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        world = dist.get_world_size(group)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.group, ctx.dim, ctx.world = group, dim, world
        ctx.rank = dist.get_rank(group)
        ctx.save_for_backward(inverse)
        return torch.cat(parts, dim=dim).index_select(dim, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        dim = ctx.dim
        # Back to rank-major order, then sum every rank's gradient for our own slice.
        rank_major = torch.zeros_like(grad).index_copy_(dim, inverse, grad.contiguous())
        if dist.get_backend(ctx.group) in ("nccl", "xccl"):
            moved = rank_major.movedim(dim, 0).contiguous()
            out = moved.new_empty((moved.shape[0] // ctx.world, *moved.shape[1:]))
            dist.reduce_scatter_tensor(out, moved, group=ctx.group)
            return out.movedim(0, dim), None, None, None
        # gloo has no reduce-scatter: all-reduce the full gradient and keep our slice.
        dist.all_reduce(rank_major, group=ctx.group)
        return rank_major.chunk(ctx.world, dim=dim)[ctx.rank].contiguous(), None, None, None


def context_parallel_all_gather(
    shard: torch.Tensor, cu_seqlens_padded: torch.Tensor, group: Any = None, dim: int = 0, *,
    gather_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather every CP rank's zigzag slice (e.g. K or V) along ``dim`` into GLOBAL slot order, with autograd.

    Gradients flow back to each rank's own slice (summed over the group). Written on ``torch.distributed``
    directly because ``torch.distributed.nn.functional.all_gather``'s gloo backward breaks on sub-groups
    that do not start at global rank 0 (it passes group ranks where global ranks are expected; torch 2.14).
    ``gather_index``: :func:`context_parallel_gather_index` computed once per batch; without it every call
    (K and V of every layer) recomputes it, with a host sync to validate the boundaries.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context_parallel_all_gather needs an initialised torch.distributed process group")
    cp_size = dist.get_world_size(group)
    if gather_index is None:
        gather_index = context_parallel_gather_index(cu_seqlens_padded, cp_size)
    inverse = gather_index.to(shard.device)
    dim = dim % shard.dim()
    if shard.shape[dim] * cp_size != inverse.numel():
        raise ValueError(
            f"shard has {shard.shape[dim]} slots along dim {dim}; with cp={cp_size} the boundaries need "
            f"{inverse.numel() // cp_size} per rank: pass this rank's partitioned tensor"
        )
    return _ContextParallelAllGather.apply(shard, inverse, group, dim)
