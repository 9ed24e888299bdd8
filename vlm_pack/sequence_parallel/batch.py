"""Any vlm_pack packed batch -> the batch DeepSpeed's ``UlyssesSPDataLoaderAdapter`` can slice.

The adapter slices EVERY tensor of a batch along dim 1 and requires ``shape[1] == T``: vlm_pack's ``cu_seq_lens_*``
(``[N + 1]``), mRoPE positions (``[C, 1, T]``) and vision tensors do not fit, and the vision tower needs the whole
row anyway. So the row becomes three ``[1, T]`` tensors the adapter slices (``input_ids``, restarting text
``position_ids``, ``labels``: it turns them into this rank's ``shift_labels``) plus ONE non-tensor entry,
``batch[SP_KEY]``, holding every forward input of the WHOLE row; the adapter replicates non-tensors to the SP group,
and the model's hooks (:mod:`.model`) run the vision tower on it and slice the language model's input.

The row is padded to a multiple of ``sp`` with one trailing fill segment (labels -100), so no sample is cut by
the padding and the boundaries stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from ..core.batch import METADATA_KEY
from ..core.packing import IGNORE_INDEX

__all__ = ["SP_KEY", "UlyssesCollator", "grouped_rows", "ulysses_batch"]

SP_KEY = "vlm_pack_sp_row"
"""Batch key of the whole row's forward inputs (replicated to the SP group, read by the model's hook)."""

_TOKEN_FILL = {"labels": IGNORE_INDEX}
_PER_TOKEN = ("input_ids", "labels", "position_ids", "token_type_ids", "mm_token_type_ids")


def _per_token(name: str, value: Any, width: int) -> bool:
    """``[1, T]`` / ``[C, 1, T]`` tensors of the row (vision tensors are per image, boundaries per segment)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != width:
        return False
    return name in _PER_TOKEN or value.shape[-2] == 1


def _restarting_positions(cu: torch.Tensor, width: int) -> torch.Tensor:
    """``[1, T]`` positions restarting at every boundary of ``cu`` (no host sync)."""
    slots = torch.arange(width, device=cu.device)
    segment = torch.searchsorted(cu[1:].to(slots.dtype), slots, right=True)
    return (slots - cu.to(slots.dtype)[segment])[None]


def ulysses_batch(batch: Mapping[str, Any], sp_size: int, pad_to_length: int | None = None) -> dict[str, Any]:
    """One packed row (any vlm_pack collator's output, ``[1, T]``) as a Ulysses batch for ``sp_size`` ranks.

    ``pad_to_length``: a fixed row width (a multiple of ``sp_size``). Needed on gloo (CPU), whose all-gather in
    the adapter requires the rows of all SP ranks to have the same width; without it the row is padded to the
    next multiple of ``sp_size``.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be an int >= 1; got {sp_size!r}")
    if pad_to_length is not None and pad_to_length % sp_size:
        raise ValueError(f"pad_to_length={pad_to_length} must be a multiple of sp_size={sp_size}")
    ids = batch.get("input_ids")
    cu = batch.get("cu_seq_lens_q")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or cu is None:
        shape = None if not isinstance(ids, torch.Tensor) else tuple(ids.shape)
        raise ValueError(
            f"sequence parallelism needs ONE packed row per micro-batch (input_ids [1, T] with cu_seq_lens_q); got "
            f"input_ids {shape}{'' if cu is not None else ' without cu_seq_lens_q'}: use a packing collator and "
            "per_device_train_batch_size=1 (grouped_rows(examples, n) packs n examples per row)"
        )
    width = ids.shape[-1]
    pad = -width % sp_size if pad_to_length is None else pad_to_length - width
    if pad < 0:
        raise ValueError(f"a packed row of {width} tokens is longer than pad_to_length={pad_to_length}: raise it")
    row: dict[str, Any] = {}
    for name, value in batch.items():
        if name == METADATA_KEY:
            continue  # bookkeeping, not a forward input
        if pad and _per_token(name, value, width):
            if name == "position_ids":
                fill = torch.arange(pad, dtype=value.dtype, device=value.device).expand(*value.shape[:-1], pad)
            else:
                fill = value.new_full((*value.shape[:-1], pad), _TOKEN_FILL.get(name, 0))
            value = torch.cat([value, fill], dim=-1)
        row[name] = value
    if pad:  # the fill is one more segment: no sample attends to it, it attends to nothing real
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if name in row:
                row[name] = torch.cat([row[name], row[name][-1:] + pad])
        for name in ("max_length_q", "max_length_k"):
            if name in row:
                row[name] = max(int(row[name]), pad)
    labels = row.pop("labels")
    return {"input_ids": row["input_ids"], "labels": labels,
            "position_ids": _restarting_positions(row["cu_seq_lens_q"], width + pad), SP_KEY: row}


@dataclass
class UlyssesCollator:
    """``collate_fn`` wrapper: ``collate(items)`` (a vlm_pack packing collator) then :func:`ulysses_batch`.

    Items that are lists (from :func:`grouped_rows`) are flattened first, so one dataset item is one packed row
    of several examples while Trainer's micro-batch stays 1 (Ulysses needs one row per micro-batch).
    """

    collate: Callable[[list[Any]], Mapping[str, Any]]
    sp_size: int
    pad_to_length: int | None = None

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        flat = [example for item in items for example in (item if isinstance(item, list) else [item])]
        return ulysses_batch(self.collate(flat), self.sp_size, self.pad_to_length)


class _Groups(Dataset):
    def __init__(self, examples: Sequence[Any], size: int) -> None:
        self.examples, self.size = examples, size

    def __len__(self) -> int:
        return -(-len(self.examples) // self.size)

    def __getitem__(self, index: int) -> list[Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return [self.examples[i] for i in range(index * self.size, min((index + 1) * self.size, len(self.examples)))]


def grouped_rows(examples: Sequence[Any], examples_per_row: int) -> Dataset:
    """A dataset whose item ``i`` is the list of examples ``[i * n, (i + 1) * n)``: with :class:`UlyssesCollator`
    and ``per_device_train_batch_size=1``, each micro-batch is one row packing ``n`` examples in order."""
    if examples_per_row < 1:
        raise ValueError(f"examples_per_row must be >= 1; got {examples_per_row}")
    return _Groups(examples, examples_per_row)
