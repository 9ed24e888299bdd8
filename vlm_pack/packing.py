"""In-batch packing: turn a padded micro-batch ``[B, S]`` into ONE packed row ``[1, T]`` with boundaries.

A tiny pack of two samples (lengths 3 and 2) with ``pad_to_multiple_of=2``::

    slot               0    1    2    3  |  4    5
    tokens            a0   a1   a2  PAD  | b0   b1
    labels            l0   l1   l2 -100  | m0   m1
    loss_mask          1    1    1    0  |  1    1
    position_ids       0    1    2    3  |  0    1      (alignment slots keep counting)
    padding_mask       F    F    F    T  |  F    F
    cu_seqlens        [0, 3, 5]                         (real tokens, logical offsets)
    cu_seqlens_padded [0, 4, 6]                         (physical boundaries: what the kernel uses)
    max_seqlen        4                                 (largest PADDED length)

Attention kernels receive ``cu_seqlens_padded``: every slot belongs to exactly one segment, so no token
attends across a boundary, and causal masking keeps real tokens from seeing their trailing alignment slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "PackedBatch", "pack_batch_sequences", "pad_multiple", "segment_ids"]

IGNORE_INDEX = -100


def pad_multiple(context_parallel_size: int = 1, tensor_parallel_size: int = 1, sequence_parallel: bool = False) -> int:
    """Length every packed sequence must be a multiple of.

    Context parallelism splits each sequence into ``2 * cp`` zigzag chunks; sequence parallelism splits the
    whole row across ``cp * tp`` ranks. The lcm satisfies both.
    """
    if context_parallel_size < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"context_parallel_size={context_parallel_size} and tensor_parallel_size={tensor_parallel_size} "
            "must both be >= 1"
        )
    cp_mult = 2 * context_parallel_size if context_parallel_size > 1 else 1
    sp_mult = context_parallel_size * tensor_parallel_size if sequence_parallel and tensor_parallel_size > 1 else 1
    return math.lcm(cp_mult, sp_mult)


def segment_ids(cu_seqlens: torch.Tensor, slots: int | torch.Tensor) -> torch.Tensor:
    """Segment index of token slots, on device without a host sync: the one segment-id helper of the library.

    ``slots`` is a slot count ``T`` (ids of slots ``0..T-1``) or a tensor of global slot indices (e.g. a
    context-parallel rank's ``zigzag_indices``). Slots at or past ``cu_seqlens[-1]`` get ``N`` (one more
    segment); empty segments own no slot. ``cu_seqlens``: ``[N+1]`` (or ``[1, N+1]``) boundaries.
    Example: ``cu_seqlens=[0, 5, 7, 11]``, 16 slots -> ``[0]*5 + [1]*2 + [2]*4 + [3]*5``.
    """
    bounds = cu_seqlens.reshape(-1)[1:]
    if isinstance(slots, torch.Tensor):
        return torch.searchsorted(bounds.to(slots.device, torch.long).contiguous(), slots.long(), right=True)
    positions = torch.arange(slots, device=bounds.device, dtype=bounds.dtype)
    return torch.searchsorted(bounds.contiguous(), positions, right=True)


@dataclass
class PackedBatch:
    """One packed row and its THD boundary metadata (names follow Megatron-Core's ``PackedSeqParams``).

    ``tokens``, ``labels``, ``loss_mask`` and ``padding_mask`` are ``[1, T]``; ``position_ids`` is ``[1, T]`` or
    ``[C, 1, T]`` (mRoPE channels). ``labels`` stay aligned with ``tokens`` (unshifted, Hugging Face
    convention); shift them inside each sample with ``vlm_pack.loss.shift_packed_labels``.
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    seq_lengths: torch.Tensor
    padding_mask: torch.Tensor

    @property
    def num_sequences(self) -> int:
        """Number of real sequences in the row (a trailing ``pad_to_length`` fill segment is not one)."""
        return self.seq_lengths.shape[0]

    def attention_kwargs(self) -> dict[str, torch.Tensor | int]:
        """Forward kwargs Hugging Face varlen attention reads (physical boundaries, padded max length)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens_padded,
            "cu_seq_lens_k": self.cu_seqlens_padded,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def to_dict(self) -> dict[str, torch.Tensor | int | None]:
        """Shallow dict of the fields (tensors are not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_COUNT_SHIFT = 32  # lengths and column sums share one int64 reduction: count << 32 | column sum


def _real_token_spans(
    tokens: torch.Tensor, padding_mask: torch.Tensor | None, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Length and start of each row's real tokens, brought to the host in the one device-to-host transfer."""
    width = tokens.shape[1]
    if padding_mask is not None:
        real = padding_mask.long()
        # One reduction gives each row's count n and column sum: weights col + 2**32 keep them in separate bits
        # while the column sum stays below 2**32 (rows up to ~92k tokens); longer rows take two reductions.
        fused = width * (width - 1) // 2 < 1 << _COUNT_SHIFT
        offset = 1 << _COUNT_SHIFT if fused else 0
        weights = torch.arange(offset, offset + width, device=tokens.device)
        col_stats = torch.mv(real, weights) if real.is_cpu else (real * weights).sum(dim=1)
        parts = [col_stats, real[:, 0]] if fused else [real.sum(dim=1), col_stats, real[:, 0]]
        host = torch.stack(parts).cpu().numpy()
        if fused:
            lengths, col_sum = host[0] >> _COUNT_SHIFT, host[0] & ((1 << _COUNT_SHIFT) - 1)
        else:
            lengths, col_sum = host[0], host[1]
        starts = np.where(host[-1] != 0, 0, width - lengths)  # a run touching column 0 is right-padded
        # n distinct columns >= s sum to n*s + n(n-1)/2 exactly when they are s..s+n-1: this proves each row is
        # a single run starting at ``starts`` (left or right padding, no holes).
        bad = (lengths > 0) & (col_sum != lengths * starts + lengths * (lengths - 1) // 2)
    else:
        not_pad = tokens != pad_token_id
        ends = torch.where(not_pad, torch.arange(1, width + 1, device=tokens.device), 0).amax(dim=1)
        host = torch.stack([ends, not_pad[:, 0].long()]).cpu().numpy()
        lengths, starts = host[0], np.zeros_like(host[0])
        # A row that opens with pad ids yet has content later is almost surely LEFT padded.
        bad = (lengths > 0) & (host[1] == 0)
    bad_rows = np.flatnonzero(bad)
    if bad_rows.size:
        row = int(bad_rows[0])
        if padding_mask is not None:
            raise ValueError(
                f"padding_mask row {row} is not one contiguous run touching the row's left or right end (a hole, "
                "or padding on both sides); a row must be left- or right-padded only. Fix the mask, or split "
                "the row into separate samples."
            )
        raise ValueError(
            f"row {row} starts with pad_token_id={pad_token_id} but has real tokens later: it looks left-padded. "
            "Pass padding_mask (or attention_mask) so real tokens are not misread, or right-pad the batch."
        )
    return lengths, starts


def _cumsum0(values: np.ndarray) -> np.ndarray:
    """Exclusive-then-total prefix sums: ``[0, v0, v0+v1, ...]``."""
    out = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def _check_shape(name: str, value: torch.Tensor | None, shape: torch.Size) -> None:
    if value is not None and value.shape[-2:] != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected trailing dims {tuple(shape)} like tokens")


def pack_batch_sequences(
    tokens: torch.Tensor,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    padding_mask: torch.Tensor | None = None,
    pad_to_length: int | None = None,
) -> PackedBatch:
    """Pack the real tokens of each row of a ``[B, S]`` batch into one ``[1, T]`` row.

    Real tokens are where ``padding_mask`` (or, if absent, the 2-D ``attention_mask``) is 1 — left or right
    padding both work. Without a mask a row runs up to and including its last token != ``pad_token_id``.
    Empty rows are dropped; row order is kept. Each sequence is padded to a multiple of
    ``pad_to_multiple_of`` with pad id / -100 / 0 / continued positions. ``position_ids`` (``[B, S]`` or
    ``[C, B, S]``) are gathered like tokens; ``None`` restarts them at 0 per sequence. ``pad_to_length`` fixes
    the total width T for static shapes: the extra slots form one trailing fill segment.

    Vectorised: exactly one device-to-host transfer (the row lengths, which decide the output shape).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S]; got shape {tuple(tokens.shape)}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1; got {pad_to_multiple_of}")
    if padding_mask is None and attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be a 2-D [B, S] padding mask; got shape {tuple(attention_mask.shape)}. "
                "Pass 4-D masks to the model, not to the packer."
            )
        padding_mask = attention_mask
    shape = tokens.shape
    for name, value in (("labels", labels), ("loss_mask", loss_mask), ("padding_mask", padding_mask)):
        _check_shape(name, value, shape)
        if value is not None and value.dim() != 2:
            raise ValueError(f"{name} must be [B, S]; got shape {tuple(value.shape)}")
    if position_ids is not None:
        _check_shape("position_ids", position_ids, shape)
        if position_ids.dim() not in (2, 3):
            raise ValueError(f"position_ids must be [B, S] or [C, B, S]; got shape {tuple(position_ids.shape)}")

    device = tokens.device
    batch, width = shape
    all_lengths, all_starts = _real_token_spans(tokens, padding_mask, pad_token_id)

    # Plan on the host (cheap O(B) numpy), then gather on the device with a handful of O(T) kernels.
    rows = np.flatnonzero(all_lengths)
    num_seqs = rows.size
    if num_seqs == 0:
        raise ValueError(
            f"all {batch} rows are empty (no real tokens): nothing to pack. Check padding_mask / pad_token_id."
        )
    m = pad_to_multiple_of
    seg_real = all_lengths[rows]
    seg_padded = -(-seg_real // m) * m
    cu_real = _cumsum0(seg_real)
    cu_padded = _cumsum0(seg_padded)
    packed_width = int(cu_padded[-1])
    max_seqlen = int(seg_padded.max())
    total = packed_width
    if pad_to_length is not None:
        if pad_to_length < packed_width:
            raise ValueError(
                f"pad_to_length={pad_to_length} is smaller than the packed width {packed_width} "
                f"({num_seqs} sequences aligned to multiples of {m}); raise pad_to_length or lower the batch size."
            )
        total = pad_to_length
    extra = total - packed_width
    if extra:
        # The trailing fill forms its own segment of real length 0, so both cu_seqlens keep equal length.
        cu_real = np.append(cu_real, cu_real[-1])
        cu_padded = np.append(cu_padded, total)
        max_seqlen = max(max_seqlen, extra)

    seg_src = rows * width + all_starts[rows]  # flat index of each sequence's first real token
    gaps = seg_padded - seg_real
    fill_seg = np.repeat(np.arange(num_seqs), gaps)
    fill_step = np.arange(fill_seg.size) - np.repeat(np.cumsum(gaps) - gaps, gaps)  # 0, 1, .. within a gap
    # Every per-slot index is a ramp that restarts at each sequence start: ones, a jump at each start, cumsum.
    src_jump = seg_src - np.concatenate([[0], seg_src[:-1] + seg_padded[:-1] - 1])
    pos_jump = 1 - np.concatenate([[1], seg_padded[:-1]])
    plan = torch.from_numpy(
        np.concatenate([
            cu_padded[:num_seqs],
            src_jump,  # slot t of sequence i reads flat index seg_src[i] + t - cu_padded[i]
            pos_jump,
            (cu_padded[:num_seqs] + seg_real)[fill_seg] + fill_step,  # alignment slots
            (seg_src + seg_real - 1)[fill_seg],  # ... and the last real token before each
            fill_step + 1,
        ]).astype(np.int64)
    ).to(device, non_blocking=True)
    boundaries = torch.from_numpy(np.concatenate([cu_real, cu_padded, seg_real]).astype(np.int32))
    cu_real_t, cu_padded_t, seg_real_t = boundaries.to(device, non_blocking=True).split(
        [cu_real.size, cu_padded.size, num_seqs]
    )
    n_fill = fill_seg.size
    seg_start, src_jump_t, pos_jump_t, fill_idx, fill_last, fill_offset = plan.split(
        [num_seqs, num_seqs, num_seqs, n_fill, n_fill, n_fill]
    )

    def ramp(jumps: torch.Tensor) -> torch.Tensor:
        steps = torch.ones(packed_width, dtype=torch.long, device=device)
        steps.index_copy_(0, seg_start, jumps)
        return steps.cumsum_(0)

    src = ramp(src_jump_t)
    if n_fill:
        src.clamp_(max=batch * width - 1)  # alignment slots read anything in range, then get overwritten

    def finish(out: torch.Tensor, fill: int) -> torch.Tensor:
        if extra:
            out = torch.cat([out, out.new_full(out.shape[:-1] + (extra,), fill)], dim=-1)
        return out.unsqueeze(-2)

    def gather(value: torch.Tensor | None, fill: int) -> torch.Tensor | None:
        if value is None:
            return None
        out = value.reshape(-1).index_select(0, src)
        if n_fill:
            out.index_fill_(0, fill_idx, fill)
        return finish(out, fill)

    if position_ids is None:
        positions = ramp(pos_jump_t)
    else:
        flat_positions = position_ids.reshape(-1, batch * width)
        # One 1-D gather per channel: index_select along dim 1 is several times slower on CPU.
        positions = torch.stack([channel.index_select(0, src) for channel in flat_positions])
        if n_fill:
            # Alignment slots keep counting from the sequence's last real position.
            last = flat_positions.index_select(1, fill_last)
            positions.index_copy_(1, fill_idx, last + fill_offset.to(positions.dtype))
        if position_ids.dim() == 2:
            positions = positions[0]
    if extra:
        tail = torch.arange(extra, device=device, dtype=positions.dtype).expand(*positions.shape[:-1], extra)
        positions = torch.cat([positions, tail], dim=-1)

    fill_mask = torch.zeros(total, dtype=torch.bool, device=device)
    if n_fill:
        fill_mask.index_fill_(0, fill_idx, True)
    if extra:
        fill_mask[packed_width:] = True

    return PackedBatch(
        tokens=gather(tokens, pad_token_id),
        labels=gather(labels, IGNORE_INDEX),
        loss_mask=gather(loss_mask, 0),
        position_ids=positions.unsqueeze(-2),
        cu_seqlens=cu_real_t,
        cu_seqlens_padded=cu_padded_t,
        max_seqlen=max_seqlen,
        seq_lengths=seg_real_t,
        padding_mask=fill_mask.unsqueeze(0),
    )
