"""In-batch packing: a padded micro-batch ``[B, S]`` (``pack_batch_sequences``) or a list of per-sample
sequences (``pack_sequences``) becomes ONE packed row ``[1, T]`` with boundaries.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from itertools import accumulate, chain

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX", "PackedBatch", "chunk_boundaries", "pack_batch_sequences", "pack_sequences", "pad_multiple",
    "segment_ids",
]

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


def chunk_boundaries(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` with every segment cut into pieces of ``chunk`` slots counted from its own start, and the
    longest piece: chunked local attention (Llama 4's "chunked_attention" layers) of a packed row is causal
    attention over these pieces, exactly as each sample alone is cut at multiples of ``chunk`` from position 0.
    One host read of the boundaries. Example: ``[0, 5, 7]``, chunk 2 -> ``[0, 2, 4, 5, 7]``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    bounds = cu_seqlens.reshape(-1).tolist()
    cuts = [bounds[0]]
    for start, end in zip(bounds[:-1], bounds[1:]):
        cuts.extend(range(start + chunk, end, chunk))
        cuts.append(end)
    out = torch.tensor(cuts, dtype=torch.int32, device=cu_seqlens.device)
    return out, int(max((b - a for a, b in zip(cuts[:-1], cuts[1:])), default=0))


@dataclass
class PackedBatch:
    """One packed row and its THD boundary metadata (names follow Megatron-Core's ``PackedSeqParams``).

    ``tokens``, ``labels``, ``loss_mask`` and ``padding_mask`` are ``[1, T]``; ``position_ids`` is ``[1, T]`` or
    ``[C, 1, T]`` (mRoPE channels). ``labels`` stay aligned with ``tokens`` (unshifted, Hugging Face
    convention); shift them inside each sample with ``vlm_pack.core.loss.shift_packed_labels``.
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
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ---------------------------------------------------------------- argument checks


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    """A whole-number argument (Python or numpy int; not bool, float or str), optionally >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{name} must be an int; got {value!r} ({type(value).__name__}). Pass a whole number, e.g. {name}=4."
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def _check_ids(name: str, value: torch.Tensor) -> None:
    """Token ids, labels and positions are integers: a float or bool tensor means the wrong field was passed."""
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(
            f"{name} must be an integer tensor (ids); got dtype {value.dtype}. Pass the integer ids "
            f"(e.g. {name}.long() if the values are whole numbers)."
        )


def _check_mask_dtype(value: torch.Tensor) -> None:
    if value.dtype != torch.bool and (value.dtype.is_floating_point or value.dtype.is_complex):
        raise ValueError(
            f"padding_mask / attention_mask must be bool or integer 0/1; got dtype {value.dtype}. "
            "Pass mask.bool() for a 0.0/1.0 mask (a fractional value has no packing meaning)."
        )


# ---------------------------------------------------------------- the layout plan (host, O(sequences))


@dataclass(frozen=True)
class _Layout:
    """Where each sequence lands in the packed row. Plain Python lists: at micro-batch sizes a list
    comprehension is cheaper than the fixed cost of a numpy call, and these lists have one entry per sequence
    (or alignment slot)."""

    lengths: list[int]  # real length of each sequence
    gaps: list[int]  # alignment slots after each sequence
    cu_real: list[int]  # real boundaries (+ the empty trailing fill segment when extra > 0)
    cu_padded: list[int]  # physical boundaries (+ the trailing fill segment)
    width: int  # slots taken by the sequences (without the trailing fill)
    extra: int  # trailing fill slots up to pad_to_length
    max_seqlen: int
    fill_slots: list[int]  # slot of every alignment slot ...
    fill_steps: list[int]  # ... and how far (1, 2, ..) it lies past its sequence's last real token

    @property
    def total(self) -> int:
        return self.width + self.extra

    def boundaries(self) -> np.ndarray:
        """``cu_real``, ``cu_padded`` and ``lengths`` in one int32 array (one transfer to the device)."""
        return np.array(self.cu_real + self.cu_padded + self.lengths, dtype=np.int32)


def _layout(lengths: list[int], multiple: int, pad_to_length: int | None) -> _Layout:
    padded = [-(-n // multiple) * multiple for n in lengths] if multiple > 1 else lengths
    cu_real, cu_padded = [0, *accumulate(lengths)], [0, *accumulate(padded)]
    gaps = [p - n for p, n in zip(padded, lengths)]
    width, max_seqlen = cu_padded[-1], max(padded)
    slots: list[int] = []
    steps: list[int] = []
    if multiple > 1:
        slots = [start + n + k for start, n, gap in zip(cu_padded, lengths, gaps) for k in range(gap)]
        steps = [k for gap in gaps for k in range(1, gap + 1)]
    extra = 0
    if pad_to_length is not None:
        if pad_to_length < width:
            raise ValueError(
                f"pad_to_length={pad_to_length} is smaller than the packed width {width} ({len(lengths)} "
                f"sequences aligned to multiples of {multiple}); raise pad_to_length or lower the batch size."
            )
        extra = pad_to_length - width
    if extra:
        # The trailing fill forms its own segment of real length 0, so both cu_seqlens keep equal length.
        cu_real.append(cu_real[-1])
        cu_padded.append(pad_to_length)
        max_seqlen = max(max_seqlen, extra)
    return _Layout(list(lengths), gaps, cu_real, cu_padded, width, extra, max_seqlen, slots, steps)


def _check_options(pad_token_id: object, pad_to_multiple_of: object, pad_to_length: object) -> None:
    _check_int("pad_token_id", pad_token_id)
    multiple = _check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
    if pad_to_length is not None:
        _check_int("pad_to_length", pad_to_length, minimum=1)
        if pad_to_length % multiple:
            raise ValueError(
                f"pad_to_length={pad_to_length} is not a multiple of pad_to_multiple_of={multiple}: the trailing "
                f"fill segment would break the alignment. Use pad_to_length={-(-pad_to_length // multiple) * multiple}."
            )


# ---------------------------------------------------------------- assembly (shared by both entry points)
#
# Every field is joined from per-sequence pieces (views of the input) and views of one small fill tensor in ONE
# concatenation. On CPU the pieces are numpy views: numpy's per-call overhead is a fraction of torch's, which is
# what decides the speed at VLM micro-batch sizes (2-16 rows), and its copies are single-threaded.

_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64})

Piece = torch.Tensor | np.ndarray  # a per-sequence view: numpy on the CPU path, a tensor on the torch path


def _numpy_ready(values: Iterable[torch.Tensor | None]) -> bool:
    """True when every tensor is a plain CPU tensor numpy can view (no autograd, no exotic dtype)."""
    return all(
        value is None or (value.is_cpu and value.dtype in _NUMPY_DTYPES and not value.requires_grad)
        for value in values
    )


@lru_cache(maxsize=64)
def _numpy_filler(shape: tuple[int, ...], fill: int, dtype: np.dtype) -> np.ndarray:
    """A read-only block of ``fill``: alignment gaps are small and repeat, so calls share their fill blocks."""
    filler = np.full(shape, fill, dtype=dtype)
    filler.setflags(write=False)
    return filler


def _join(pieces: Sequence[Piece], gaps: list[int], extra: int, fill: int) -> Piece:
    """Concatenate pieces (length in the last dim), ``fill`` for ``gaps[i]`` slots after piece i and for
    ``extra`` trailing slots. Fill slots are views of one small tensor: one copy kernel for the whole field."""
    first = pieces[0]
    numpy = isinstance(first, np.ndarray)
    concat = np.concatenate if numpy else torch.cat
    longest = max(max(gaps), extra)
    if not longest:
        return concat(pieces, -1)
    shape = (*first.shape[:-1], longest)
    filler = _numpy_filler(shape, fill, first.dtype) if numpy else first.new_full(shape, fill)
    parts: list[Piece] = []
    for piece, gap in zip(pieces, gaps):
        parts.append(piece)
        if gap:
            parts.append(filler[..., :gap])
    if extra:
        parts.append(filler[..., :extra])
    return concat(parts, -1)


def _restarting_positions(layout: _Layout, device: torch.device, numpy: bool) -> Piece:
    """``0, 1, ..`` restarting at every physical boundary (alignment slots keep counting; so does the fill)."""
    cu = layout.cu_padded
    sizes = [end - start for start, end in zip(cu, cu[1:])]
    if numpy:  # one arange, cut into views, joined: a plain copy
        ramp = np.arange(max(sizes))
        return np.concatenate([ramp[:size] for size in sizes])
    # On a device: ones with a jump back at every boundary, cumulated (three kernels, no per-sequence work).
    plan = torch.tensor([cu[1:-1], [1 - size for size in sizes[:-1]]], dtype=torch.long).to(device, non_blocking=True)
    steps = torch.ones(layout.total, dtype=torch.long, device=device)
    steps[0] = 0
    steps.index_copy_(0, plan[0], plan[1])
    return steps.cumsum_(0)


def _assemble(
    layout: _Layout,
    device: torch.device,
    pad_token_id: int,
    tokens: Sequence[Piece],
    labels: Sequence[Piece] | None,
    loss_mask: Sequence[Piece] | None,
    positions: Sequence[Piece] | None,
) -> PackedBatch:
    """The PackedBatch from per-sequence pieces (real tokens only, numpy views or tensors) and the layout."""
    numpy = isinstance(tokens[0], np.ndarray)
    gaps, extra = layout.gaps, layout.extra
    fill = None
    if layout.fill_slots:  # rows: alignment slot, its sequence's last real slot, distance between them
        last = [slot - step for slot, step in zip(layout.fill_slots, layout.fill_steps)]
        fill = np.array([layout.fill_slots, last, layout.fill_steps], dtype=np.int64)
    if not numpy and fill is not None:
        fill = torch.from_numpy(fill).to(device, non_blocking=True)

    if positions is None:
        packed_positions = _restarting_positions(layout, device, numpy)
    else:
        # Pieces are [n] or [C, n]. Alignment slots count on from their sequence's last real position; the
        # trailing fill segment counts from 0 like any sequence.
        pieces, piece_gaps = positions, gaps
        if extra:
            lead, dtype = positions[0].shape[:-1], positions[0].dtype
            tail = np.broadcast_to(np.arange(extra, dtype=dtype), (*lead, extra)) if numpy else \
                torch.arange(extra, device=device, dtype=dtype).expand(*lead, extra)
            pieces, piece_gaps = [*positions, tail], [*gaps, 0]
        packed_positions = _join(pieces, piece_gaps, 0, 0)
        if fill is not None:
            slots, last, steps = fill
            if numpy:
                packed_positions[..., slots] = packed_positions[..., last] + steps.astype(packed_positions.dtype)
            else:
                values = packed_positions.index_select(-1, last) + steps.to(packed_positions.dtype)
                packed_positions.index_copy_(-1, slots, values)

    if numpy:
        fill_mask = np.zeros(layout.total, dtype=bool)
    else:
        fill_mask = torch.zeros(layout.total, dtype=torch.bool, device=device)
    if fill is not None:
        fill_mask[fill[0]] = True
    if extra:
        fill_mask[layout.width:] = True

    def out(value: Piece | None) -> torch.Tensor | None:
        if value is None:
            return None
        return torch.from_numpy(value[..., None, :]) if numpy else value.unsqueeze(-2)

    def field(pieces: Sequence[Piece] | None, fill_value: int) -> torch.Tensor | None:
        return None if pieces is None else out(_join(pieces, gaps, extra, fill_value))

    n_cu = len(layout.cu_real)
    bounds = layout.boundaries()
    if numpy:  # three views, made on the numpy side (cheaper than slicing tensors)
        cu_real, cu_padded, seq_lengths = (torch.from_numpy(bounds[:n_cu]), torch.from_numpy(bounds[n_cu:2 * n_cu]),
                                           torch.from_numpy(bounds[2 * n_cu:]))
    else:
        cu_real, cu_padded, seq_lengths = torch.from_numpy(bounds).to(device, non_blocking=True).split(
            [n_cu, n_cu, len(layout.lengths)])
    return PackedBatch(
        tokens=field(tokens, pad_token_id),
        labels=field(labels, IGNORE_INDEX),
        loss_mask=field(loss_mask, 0),
        position_ids=out(packed_positions),
        cu_seqlens=cu_real,
        cu_seqlens_padded=cu_padded,
        max_seqlen=layout.max_seqlen,
        seq_lengths=seq_lengths,
        padding_mask=out(fill_mask),
    )


# ---------------------------------------------------------------- threads


class _OneIntraOpThread:
    """Run torch kernels on CPU tensors on one intra-op thread (a no-op when ``active`` is False).

    The work is a few memory copies; splitting them across OpenMP threads gains little on an idle machine and,
    when another core is busy (a training step, a DataLoader worker), makes each parallel kernel wait for a
    descheduled thread: the previous all-torch core took 36x its single-thread time at micro-batch 32
    (``benchmarks/in_batch_threads.py``). The numpy path (plain CPU tensors) runs no parallel kernel at all and
    skips this. ``torch.set_num_threads`` is per calling thread under OpenMP and costs well under a microsecond.
    """

    def __init__(self, active: bool) -> None:
        self.previous = torch.get_num_threads() if active else 1

    def __enter__(self) -> None:
        if self.previous > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.previous > 1:
            torch.set_num_threads(self.previous)


# ---------------------------------------------------------------- padded input


def _real_token_spans(
    tokens: torch.Tensor, padding_mask: torch.Tensor | None, pad_token_id: int
) -> tuple[list[int], list[int]]:
    """Length and start of each row's real tokens: numpy on CPU, else device reductions and ONE transfer.
    Per-row bookkeeping is plain Python: cheaper than numpy calls at micro-batch sizes."""
    batch, width = tokens.shape
    on_host = tokens.device.type == "cpu" and (padding_mask is None or padding_mask.device.type == "cpu")
    if padding_mask is None:
        if on_host:
            not_pad = tokens.numpy() != pad_token_id
            ends = np.where(not_pad.any(axis=1), width - np.argmax(not_pad[:, ::-1], axis=1), 0).tolist()
            opens = not_pad[:, 0].tolist()
        else:
            not_pad = tokens != pad_token_id
            ends = torch.where(not_pad, torch.arange(1, width + 1, device=tokens.device), 0).amax(dim=1)
            ends, opens = torch.stack([ends, not_pad[:, 0].long()]).tolist()
        for row, (end, open_) in enumerate(zip(ends, opens)):
            if end and not open_:  # opens with pad ids yet has content later: almost surely LEFT padded
                raise ValueError(
                    f"row {row} starts with pad_token_id={pad_token_id} but has real tokens later: it looks "
                    "left-padded. Pass padding_mask (or attention_mask) so real tokens are not misread, or "
                    "right-pad the batch."
                )
        return ends, [0] * batch

    # One product gives each row's count n and column sum: weights col + 2**32 keep them in separate bits while
    # the column sum stays below 2**32 (rows up to ~92k tokens); longer rows take a separate count.
    fused = width * (width - 1) // 2 < 1 << _COUNT_SHIFT
    offset = 1 << _COUNT_SHIFT if fused else 0
    checked = padding_mask.dtype != torch.bool  # 0/1 only: a 2 or -1 would corrupt the counts
    if on_host:
        real = padding_mask.numpy()
        if checked and real.view(_UNSIGNED[real.itemsize]).max() > 1:  # unsigned view: one pass finds -1 and 2 alike
            _check_mask_values(int(real.min()), int(real.max()))
        col_stats = np.dot(real, _column_weights(offset, width)).tolist()
        counts = None if fused else np.count_nonzero(real, axis=1).tolist()
        first = real[:, 0].tolist()
    else:
        real = padding_mask.long()
        weights = torch.arange(offset, offset + width, device=tokens.device)
        parts = [(real * weights).sum(dim=1), real[:, 0]]
        if not fused:
            parts.append(real.sum(dim=1))
        if checked:
            parts.append(torch.stack(torch.aminmax(real)).repeat_interleave(batch))
        host = torch.cat(parts).view(-1, batch).tolist()
        if checked:
            _check_mask_values(host[-1][0], host[-1][-1])
        col_stats, first, counts = host[0], host[1], None if fused else host[2]
    if fused:
        counts = [stats >> _COUNT_SHIFT for stats in col_stats]
        col_stats = [stats & ((1 << _COUNT_SHIFT) - 1) for stats in col_stats]
    starts = [0 if opens else width - n for n, opens in zip(counts, first)]  # touching column 0: right-padded
    for row, (n, start, col_sum) in enumerate(zip(counts, starts, col_stats)):
        # n distinct columns >= s sum to n*s + n(n-1)/2 exactly when they are s..s+n-1: this proves the row is
        # a single run starting at ``start`` (left or right padding, no holes).
        if n and col_sum != n * start + n * (n - 1) // 2:
            raise ValueError(
                f"padding_mask row {row} is not one contiguous run touching the row's left or right end (a hole, "
                "or padding on both sides); a row must be left- or right-padded only. Fix the mask, or split "
                "the row into separate samples."
            )
    return counts, starts


@lru_cache(maxsize=8)
def _column_weights(offset: int, width: int) -> np.ndarray:
    weights = np.arange(offset, offset + width)
    weights.setflags(write=False)
    return weights


def _check_mask_values(low: int, high: int) -> None:
    if low < 0 or high > 1:
        raise ValueError(
            f"padding_mask / attention_mask must hold only 0 and 1; found {low if low < 0 else high}. "
            "Pass (mask > 0) or mask.bool() once you know what the other values mean."
        )


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
    ``[C, B, S]``) are gathered like tokens; ``None`` restarts them at 0 per sequence. ``pad_to_length`` (a
    multiple of ``pad_to_multiple_of``) fixes the total width T for static shapes: the extra slots form one
    trailing fill segment.

    Exactly one device-to-host transfer (the row lengths, which decide the output shape); then each field is
    cut into per-row views in one ``split`` and joined with its fill slots in one ``cat``. With
    ``pad_to_multiple_of=4`` and two rows of 3 and 6 real tokens (``p``: alignment fill)::

        tokens        a1 a2 a3 p | b1 b2 b3 b4 b5 b6 p  p
        labels        a1 a2 a3 - | b1 b2 b3 b4 b5 b6 -  -      (unshifted; - is -100)
        position_ids  0  1  2  3 | 0  1  2  3  4  5  6  7
        cu_seqlens          [0, 3, 9]    (cumulative real lengths)
        cu_seqlens_padded   [0, 4, 12]   (physical boundaries: what attention and the loss read)

    Args:
        tokens: ``[B, S]`` token ids.
        labels: ``[B, S]`` targets aligned with ``tokens`` (-100 where ignored); None: none in the result.
        loss_mask: ``[B, S]`` per-token loss weights; None: none in the result.
        attention_mask: a 2-D ``[B, S]`` padding mask (used when ``padding_mask`` is None).
        position_ids: ``[B, S]`` or ``[C, B, S]``; None restarts them at 0 per sequence.
        pad_token_id: the fill token, and what marks padding when no mask is given.
        pad_to_multiple_of: each sequence's slots are a multiple of it (context / tensor parallel splits).
        padding_mask: ``[B, S]``, 1 on real tokens.
        pad_to_length: the total width T (static shapes).

    Returns:
        A :class:`PackedBatch`: ``[1, T]`` fields and the row's boundaries.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S]; got shape {tuple(tokens.shape)}")
    _check_options(pad_token_id, pad_to_multiple_of, pad_to_length)
    batch, width = tokens.shape
    if batch == 0 or width == 0:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)}: no slot to pack. Pass at least one row with at least one token."
        )
    _check_ids("tokens", tokens)
    if padding_mask is None and attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be a 2-D [B, S] padding mask; got shape {tuple(attention_mask.shape)}. "
                "Pass 4-D masks to the model, not to the packer."
            )
        padding_mask = attention_mask
    for name, value in (("labels", labels), ("loss_mask", loss_mask), ("padding_mask", padding_mask)):
        _check_shape(name, value, tokens.shape)
        if value is not None and value.dim() != 2:
            raise ValueError(f"{name} must be [B, S]; got shape {tuple(value.shape)}")
    if labels is not None:
        _check_ids("labels", labels)
    if padding_mask is not None:
        _check_mask_dtype(padding_mask)
    if position_ids is not None:
        _check_shape("position_ids", position_ids, tokens.shape)
        if position_ids.dim() not in (2, 3):
            raise ValueError(f"position_ids must be [B, S] or [C, B, S]; got shape {tuple(position_ids.shape)}")
        _check_ids("position_ids", position_ids)

    fields = (tokens, labels, loss_mask, position_ids)
    numpy = _numpy_ready(fields)
    with _OneIntraOpThread(active=tokens.is_cpu and not numpy):
        all_lengths, all_starts = _real_token_spans(tokens, padding_mask, pad_token_id)
        rows = [row for row, length in enumerate(all_lengths) if length]
        if not rows:
            raise ValueError(
                f"all {batch} rows are empty (no real tokens): nothing to pack. Check padding_mask / pad_token_id."
            )
        lengths = [all_lengths[row] for row in rows]
        layout = _layout(lengths, pad_to_multiple_of, pad_to_length)
        # Each kept row's real run [begin, end) in the flattened batch: numpy slices on CPU, else one split
        # of the flat tensor at every run's start and end (views only).
        begin = [row * width + all_starts[row] for row in rows]
        end = [start + n for start, n in zip(begin, lengths)]
        if numpy:
            spans = list(zip(begin, end))

            def runs(value: torch.Tensor | None) -> list[np.ndarray] | None:
                if value is None:
                    return None
                flat = value.numpy().reshape(*value.shape[:-2], batch * width)
                return [flat[..., start:stop] for start, stop in spans]
        else:
            cuts = [size for start, stop, n in zip(begin, [0, *end], lengths) for size in (start - stop, n)]
            cuts.append(batch * width - end[-1])

            def runs(value: torch.Tensor | None) -> list[torch.Tensor] | None:
                if value is None:
                    return None
                return value.reshape(*value.shape[:-2], batch * width).split_with_sizes(cuts, dim=-1)[1::2]

        return _assemble(layout, tokens.device, int(pad_token_id), *(runs(value) for value in fields))


# ---------------------------------------------------------------- per-sample input


def _samples(name: str, values: object, count: int | None) -> list[Piece]:
    """One field's samples as tensors or numpy arrays. Python lists are joined and converted in ONE call (what a
    tokenised dataset yields; a per-sample conversion would cost more than the packing)."""
    if not (type(values) in (list, tuple) or isinstance(values, Sequence)) or not values or \
            isinstance(values, (torch.Tensor, np.ndarray, str, bytes)):
        what = "a padded tensor" if isinstance(values, (torch.Tensor, np.ndarray)) else repr(values)[:40]
        raise ValueError(
            f"{name} must be a non-empty list with one 1-D tensor (or list of ids) per sample; got {what}. "
            "For a padded [B, S] batch use pack_batch_sequences."
        )
    if count is not None and len(values) != count:
        raise ValueError(f"{name} has {len(values)} samples but tokens has {count}; pass one per sample")
    if isinstance(values[0], torch.Tensor):
        return list(values)
    if isinstance(values[0], (list, tuple)):
        flat = np.array(list(chain.from_iterable(values)))  # ints -> int64; a float or bool shows in the dtype
        if flat.ndim != 1:
            raise ValueError(f"{name}: give each sample as a flat list of ints (or a tensor, e.g. [C, n] positions)")
        if name != "loss_mask" and flat.dtype.kind not in "iu" and flat.size:
            index, value = next((i, x) for i, sample in enumerate(values) for x in sample
                                if isinstance(x, bool) or not isinstance(x, (int, np.integer)))
            raise ValueError(f"{name}[{index}] must hold integer ids; found {value!r}. Pass whole-number ids.")
        offsets = [0, *accumulate(len(value) for value in values)]
        return [flat[start:stop] for start, stop in zip(offsets, offsets[1:])]
    return [value if isinstance(value, torch.Tensor) else np.asarray(value) for value in values]


_PLAIN_IDS = frozenset({torch.int64, torch.int32, np.dtype(np.int64), np.dtype(np.int32)})


def _check_samples(name: str, values: list[Piece], lengths: list[int] | None, channels: bool) -> None:
    """One 1-D tensor per sample (``[C, n]`` where ``channels``), ``lengths`` long, integer ids unless loss_mask."""
    dims = (1, 2) if channels else (1,)
    for index, value in enumerate(values):
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise ValueError(f"{name}[{index}] is a {type(value).__name__}; give every sample as a tensor or list")
        if value.ndim not in dims or (lengths is not None and value.shape[-1] != lengths[index]):
            length = value.shape[-1] if lengths is None else lengths[index]
            expected = f"[{length}] or [C, {length}]" if channels else f"[{length}]"
            hint = " (t.reshape(-1) for a [1, n] sample)" if name == "tokens" else f" matching tokens[{index}]"
            raise ValueError(f"{name}[{index}] has shape {tuple(value.shape)}; expected {expected}{hint}")
    dtypes = {value.dtype for value in values}
    if name != "loss_mask" and not dtypes <= _PLAIN_IDS:
        for dtype in dtypes:  # each distinct dtype once, reported at its first sample
            index = next(i for i, value in enumerate(values) if value.dtype == dtype)
            if isinstance(dtype, np.dtype):
                if dtype.kind not in "iu" and values[index].size:
                    raise ValueError(f"{name}[{index}] must hold integer ids; got {dtype} values")
            else:
                _check_ids(f"{name}[{index}]", values[index])
    if channels and len({value.shape[:-1] for value in values}) > 1:
        raise ValueError(f"{name} mixes channel layouts; give every sample the same [n] or [C, n] shape")


def pack_sequences(
    tokens: Sequence[torch.Tensor | Sequence[int]],
    labels: Sequence[torch.Tensor | Sequence[int]] | None = None,
    loss_mask: Sequence[torch.Tensor | Sequence[float]] | None = None,
    position_ids: Sequence[torch.Tensor | Sequence[int]] | None = None,
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    pad_to_length: int | None = None,
) -> PackedBatch:
    """Pack per-sample sequences (1-D tensors, or lists of ids as a tokenised dataset yields) into one row.

    The result equals ``pack_batch_sequences`` on the same samples right-padded into ``[B, S]``, without
    building that batch: each field is joined with its alignment fill in one concatenation. Lengths are known
    on the host, so there is no host sync at all. ``position_ids[i]`` is ``[n_i]`` or ``[C, n_i]`` (mRoPE
    channels); ``None`` restarts at 0 per sample. Empty samples are dropped; order is kept. Tensors on one device.

    Args:
        tokens: one sequence of ids per sample.
        labels / loss_mask / position_ids: per sample, the same lengths as ``tokens``; None: not in the result
            (positions: restarting at 0).
        pad_token_id / pad_to_multiple_of / pad_to_length: as :func:`pack_batch_sequences`.

    Returns:
        A :class:`PackedBatch` equal to :func:`pack_batch_sequences`' on the right-padded batch.
    """
    _check_options(pad_token_id, pad_to_multiple_of, pad_to_length)
    token_samples = _samples("tokens", tokens, None)
    _check_samples("tokens", token_samples, None, channels=False)
    all_lengths = [value.shape[0] for value in token_samples]
    fields = [token_samples]
    for name, values in (("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids)):
        samples = None if values is None else _samples(name, values, len(all_lengths))
        if samples is not None:
            _check_samples(name, samples, all_lengths, channels=name == "position_ids")
        fields.append(samples)
    tensors = [value for samples in fields if samples is not None for value in samples
               if isinstance(value, torch.Tensor)]
    devices = {value.device for value in tensors} if not all(value.is_cpu for value in tensors) else set()
    if len(devices) > 1:
        raise ValueError(f"the samples are on several devices ({sorted(map(str, devices))}); move them to one")

    keep = [index for index, length in enumerate(all_lengths) if length]
    if not keep:
        raise ValueError(f"all {len(all_lengths)} samples are empty (no tokens): nothing to pack")
    device = devices.pop() if devices else torch.device("cpu")
    numpy = _numpy_ready(tensors)

    def pieces(samples: list[Piece] | None) -> list[Piece] | None:
        if samples is None:
            return None
        chosen = samples if len(keep) == len(samples) else [samples[i] for i in keep]
        if numpy:
            return [value.numpy() if isinstance(value, torch.Tensor) else value for value in chosen]
        return [value if isinstance(value, torch.Tensor) else torch.from_numpy(value).to(device) for value in chosen]

    with _OneIntraOpThread(active=device.type == "cpu" and not numpy):
        layout = _layout([all_lengths[i] for i in keep], pad_to_multiple_of, pad_to_length)
        return _assemble(layout, device, int(pad_token_id), *(pieces(samples) for samples in fields))
