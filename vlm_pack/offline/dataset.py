"""Offline packing, step 2: serve packs for training.

* :class:`PackedSFTDataset` reads what ``vlm-pack prepare`` wrote (memory-mapped, no pickle) and its
  ``collate_fn`` turns ONE pack (micro-batch size 1) into a model-ready batch (``vlm_pack.core.batch``):
  ``input_ids``, ``labels`` (aligned with the tokens, -100 outside responses and at every sample's first token;
  the shift happens in the loss, inside each sample), ``position_ids`` (restarting per sample), all ``[1, T]``,
  and the Hugging Face varlen kwargs ``cu_seq_lens_q/k`` (1-D int32, physical boundaries) and
  ``max_length_q/k`` (int). Megatron-style fields sit in ``batch["vlm_pack"]``: ``loss_mask`` ``[1, T]``,
  ``cu_seqlens`` ``[1, K]`` int32 (physical) + ``cu_seqlens_argmin`` (valid entries); with
  ``pad_seq_to_mult > 1`` also ``cu_seqlens_unpadded`` (+ argmin, real boundaries); ``max_seqlen`` ``[1, 1]``
  (Megatron's ``tokens`` is ``input_ids``). The per-sample alignment padding, fill segment and position ids come
  from the core ``pack_batch_sequences``.
  ``pad_to_max_length`` makes T = pack size (the fill is one trailing segment); ``pad_cu_seqlens`` (CUDA
  graphs) also fixes the shape of ``cu_seqlens`` to ``max_samples_per_bin + 2`` entries (the final boundary
  repeated: zero-length segments every kernel accepts) and ``max_seqlen`` to the pack size.
* :class:`PackedDataset` packs an already tokenised Hugging Face dataset in memory for the ``Trainer``:
  each item is one pack, and :meth:`PackedDataset.collate` flattens a batch of packs into one row with
  ``cu_seq_lens_q/k`` (what ``flash_attention_2`` and our ``vlm_pack_varlen`` read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..core.batch import METADATA_KEY, mask_first_labels
from ..core.packing import IGNORE_INDEX, pack_batch_sequences
from .algorithms import group_by_pack, pack_lengths, packing_stats
from .storage import gather_segments, metadata_entry_for, open_packed, read_metadata


class PackedSFTDataset(torch.utils.data.Dataset):
    """Packs written by ``vlm-pack prepare`` (or, with ``allow_pickle=True``, the reference ``.npy`` format).

    ``path``: ``.../training_<size>.npy``. ``metadata``: the ``<size>_metadata.jsonl`` path, its parsed entries,
    or one entry dict; needed by ``pad_cu_seqlens`` (it fixes the cu_seqlens shape from ``max_samples_per_bin``,
    the largest over all splits so training and validation share one shape).
    """

    def __init__(
        self,
        path: str | Path,
        pack_size: int,
        *,
        metadata: str | Path | Mapping | Sequence[Mapping] | None = None,
        pad_to_max_length: bool = False,
        pad_cu_seqlens: bool = False,
        pad_seq_to_mult: int = 1,
        pad_token_id: int = 0,
        allow_pickle: bool = False,
        reference_loss_mask_shifted: bool = True,
    ):
        if pack_size < 1 or pad_seq_to_mult < 1:
            raise ValueError(f"pack_size ({pack_size}) and pad_seq_to_mult ({pad_seq_to_mult}) must be >= 1")
        if pad_cu_seqlens and not pad_to_max_length:
            raise ValueError(
                "pad_cu_seqlens=True needs pad_to_max_length=True: fixed-shape cu_seqlens (CUDA graphs) only make "
                "sense when every pack has the same length; set pad_to_max_length=True"
            )
        if pad_cu_seqlens and metadata is None:
            raise ValueError(
                "pad_cu_seqlens=True needs the pack metadata (max_samples_per_bin fixes the cu_seqlens shape); pass "
                "metadata='<dir>/<pack_size>_metadata.jsonl' written by `vlm-pack prepare`"
            )
        if pad_to_max_length and pack_size % pad_seq_to_mult:
            raise ValueError(
                f"pack_size={pack_size} must be a multiple of pad_seq_to_mult={pad_seq_to_mult} when padding to the "
                "pack size (the fill segment must stay aligned too)"
            )
        self.path = Path(path)
        self.pack_size = int(pack_size)
        self.pad_to_max_length = pad_to_max_length
        self.pad_cu_seqlens = pad_cu_seqlens
        self.pad_seq_to_mult = int(pad_seq_to_mult)
        self.pad_token_id = int(pad_token_id)
        self._open_args = {"allow_pickle": allow_pickle, "reference_loss_mask_shifted": reference_loss_mask_shifted}
        self.data = open_packed(path, **self._open_args)
        written = metadata_entry_for(self.path)  # prepare's own record, already checked against the files
        if self._fits_as_written(written):  # O(1) open: prepare checked every pack at write time
            self.max_samples_per_bin = int(written["max_samples_per_bin"])
        else:
            self._check_pack_lengths()
            per_pack = self.data.samples_per_pack()
            self.max_samples_per_bin = int(per_pack.max()) if len(per_pack) else 0
        if metadata is not None:
            self.max_samples_per_bin = self._metadata_max_samples(metadata)
        self.cu_seqlens_entries = self.max_samples_per_bin + 2  # N+1 boundaries + a fill segment, at most

    def _fits_as_written(self, entry: Mapping | None) -> bool:
        """Whether prepare's metadata already proves every pack fits: packed for at most this pack size, with
        samples aligned to a multiple of ``pad_seq_to_mult`` (aligning to a divisor never needs more room)."""
        if entry is None or not isinstance(entry.get("max_samples_per_bin"), int):
            return False
        written_size, written_mult = entry.get("pack_size"), entry.get("pad_seq_to_mult", 1)
        return (isinstance(written_size, int) and isinstance(written_mult, int) and written_size <= self.pack_size
                and written_mult % self.pad_seq_to_mult == 0)

    def _check_pack_lengths(self) -> None:
        """Every pack, with each sample aligned to ``pad_seq_to_mult``, must fit the pack size."""
        m = self.pad_seq_to_mult
        loads = self.data.pack_loads(m)
        over = np.flatnonzero(loads > self.pack_size)
        if over.size:
            i = int(over[0])
            aligned = f" after aligning samples to multiples of {m}" if m > 1 else ""
            raise ValueError(
                f"{self.path}: pack {i} holds {loads[i]} tokens{aligned}, more than pack_size={self.pack_size} "
                f"({over.size} such packs); use the pack size the data was prepared with"
                + (f", or re-run `vlm-pack prepare --pad-seq-to-mult {m}`" if m > 1 else "")
            )

    def _metadata_max_samples(self, metadata) -> int:
        if isinstance(metadata, (str, Path)):
            entries = read_metadata(metadata)
        elif isinstance(metadata, Mapping):
            entries = [metadata]
        else:
            entries = list(metadata)
        matching = [e for e in entries if int(e.get("pack_size", -1)) == self.pack_size]
        if not matching or any("max_samples_per_bin" not in e for e in matching):
            raise ValueError(
                f"metadata has no entry with pack_size={self.pack_size} and max_samples_per_bin; pass the "
                f"{self.pack_size}_metadata.jsonl written together with {self.path.name}"
            )
        declared = max(int(e["max_samples_per_bin"]) for e in matching)
        if declared < self.max_samples_per_bin:
            raise ValueError(
                f"metadata says at most {declared} samples per pack but {self.path} has a pack with "
                f"{self.max_samples_per_bin}; the metadata belongs to other data, re-run `vlm-pack prepare`"
            )
        return declared

    def __getstate__(self) -> dict:
        """Pickle (DataLoader workers under spawn) without copying the memory-mapped arrays: re-open instead."""
        state = dict(self.__dict__)
        state["data"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.data = open_packed(self.path, **self._open_args)

    def __len__(self) -> int:
        return self.data.num_packs

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Pack ``i`` as ``input_ids``, ``labels`` and ``position_ids`` (restarting per sample): forward-argument
        names, so ``Trainer``'s default ``remove_unused_columns`` keeps them all."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {len(self)} packs")
        tokens, loss_mask, seq_lengths = self.data.pack(i % len(self))
        m = self.pad_seq_to_mult
        if int((-(-seq_lengths // m) * m).sum()) > self.pack_size:  # cheap per pack: open skipped the full scan
            raise ValueError(
                f"{self.path}: pack {i % len(self)} holds more than pack_size={self.pack_size} tokens after aligning "
                f"samples to multiples of {m}; the files disagree with their metadata: run `vlm-pack verify` and "
                "re-run `vlm-pack prepare`"
            )
        tokens = tokens.astype(np.int64)
        starts = np.cumsum(seq_lengths) - seq_lengths
        # A sample's first token is never a target (nothing before it in its sample predicts it): masking it also
        # keeps a loss that shifts over the whole row (Hugging Face's) from predicting across a boundary.
        labels = np.where(loss_mask.astype(bool), tokens, IGNORE_INDEX)
        labels[starts] = IGNORE_INDEX
        return {"input_ids": tokens, "labels": labels, "position_ids": _positions(seq_lengths)}

    def collate_fn(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One pack -> model-ready batch (see the module docstring). Micro-batch size must be 1.

        Items come from this dataset or from its ``datasets`` view (``vlm_pack.to_hf_dataset``), whose rows carry
        ``seq_lengths`` too (TRL keeps that column, Trainer keeps ``position_ids``).
        """
        if len(batch) != 1:
            raise ValueError(
                f"offline packed data needs micro_batch_size=1 (each item is already a pack of up to {self.pack_size} "
                f"tokens), got a batch of {len(batch)}; set the DataLoader batch_size to 1 and divide the global batch "
                "size by the packing factor n from the metadata"
            )
        tokens, labels, lengths = _pack_item(batch[0])
        mask_first_labels(labels, torch.from_numpy(np.cumsum(lengths) - lengths))
        loss_mask = (labels != IGNORE_INDEX).long()
        grid = _RowGrid(lengths)  # samples as rows of a padded batch, for the core packer
        packed = pack_batch_sequences(
            grid.fill(tokens, self.pad_token_id),
            labels=grid.fill(labels, IGNORE_INDEX),
            loss_mask=grid.fill(loss_mask, 0),
            padding_mask=grid.real,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_seq_to_mult,
            pad_to_length=self.pack_size if self.pad_to_max_length else None,
        )
        meta: dict[str, Any] = {"loss_mask": packed.loss_mask}
        meta["cu_seqlens"], meta["cu_seqlens_argmin"] = self._cu(packed.cu_seqlens_padded)
        if self.pad_seq_to_mult > 1:
            meta["cu_seqlens_unpadded"], meta["cu_seqlens_unpadded_argmin"] = self._cu(packed.cu_seqlens)
        max_seqlen = self.pack_size if self.pad_cu_seqlens else int(packed.max_seqlen)
        meta["max_seqlen"] = torch.tensor([[max_seqlen]], dtype=torch.int32)
        boundaries = meta["cu_seqlens"][0]
        return {
            "input_ids": packed.tokens,
            "labels": packed.labels,
            "position_ids": packed.position_ids,
            "cu_seq_lens_q": boundaries,
            "cu_seq_lens_k": boundaries,
            "max_length_q": max_seqlen,
            "max_length_k": max_seqlen,
            METADATA_KEY: meta,
        }

    def _cu(self, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, K]`` int32 boundaries (padded by repeating the last one under ``pad_cu_seqlens``) and argmin."""
        valid = cu.numel()
        if self.pad_cu_seqlens:
            if valid > self.cu_seqlens_entries:
                raise ValueError(
                    f"a pack has {valid - 1} segments but the metadata allows {self.cu_seqlens_entries - 1}; the "
                    "metadata belongs to other data, re-run `vlm-pack prepare`"
                )
            cu = torch.cat([cu, cu[-1:].expand(self.cu_seqlens_entries - valid)])
        return cu.to(torch.int32).unsqueeze(0), torch.tensor([[valid]], dtype=torch.int64)


class _RowGrid:
    """Scatter a flat run of samples into a ``[N, longest]`` padded batch (vectorised)."""

    def __init__(self, lengths: np.ndarray):
        n, width, total = len(lengths), int(lengths.max()), int(lengths.sum())
        starts = np.cumsum(lengths) - lengths
        self.row = torch.from_numpy(np.repeat(np.arange(n), lengths))
        self.col = torch.from_numpy(np.arange(total) - np.repeat(starts, lengths))
        self.real = torch.zeros(n, width, dtype=torch.bool)
        self.real[self.row, self.col] = True

    def fill(self, flat: torch.Tensor, pad: int) -> torch.Tensor:
        out = flat.new_full(self.real.shape, pad)
        out[self.row, self.col] = flat
        return out


class PackedDataset(torch.utils.data.Dataset):
    """In-memory packing of a tokenised Hugging Face dataset (``input_ids``, optional ``labels``) for the Trainer.

    ``PackedDataset(ds, tokenizer, pack_len)`` bin-packs the samples once (``algorithm``, ``seed``); item ``i`` is
    pack ``i``: ``input_ids``, ``labels`` (the sample's own labels, or its input_ids, with -100 at every sample's
    first token, so a loss that shifts over the whole row never predicts across a boundary) and ``position_ids``
    (restart per sample; the boundaries are read from them, and all three are forward-argument names, so Trainer's
    default ``remove_unused_columns`` keeps them). Use ``data_collator=packed.collate``; with
    ``pad_to_multiple_of`` the collated row is filled up to a multiple with the tokenizer's pad id (a trailing
    segment of its own, labels -100). The row carries its bookkeeping under ``batch["vlm_pack"]`` like every vlm_pack
    batch (boundaries, real lengths): ``Trainer(compute_loss_func=vlm_pack.compute_loss_func)``, ``SampleMeanLoss``
    and ``PackedEvaluation`` then score it in chunks, never holding the row's ``T x V`` logits.
    """

    def __init__(self, dataset, tokenizer, pack_len: int, *, algorithm: str = "best_fit_decreasing", seed: int = 0,
                 pad_to_multiple_of: int = 1):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pack_len = int(pack_len)
        self.algorithm = algorithm
        self.pad_to_multiple_of = int(pad_to_multiple_of)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0))
        self.tokens, offsets = _list_column(dataset, "input_ids")
        names = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
        if "labels" in names:
            self.labels, label_offsets = _list_column(dataset, "labels")
            if not np.array_equal(offsets, label_offsets):
                row = int(np.flatnonzero(np.diff(offsets) != np.diff(label_offsets))[0])
                raise ValueError(f"sample {row}: labels and input_ids have different lengths; they must be aligned")
        else:
            self.labels = self.tokens.copy()
        self.lengths = np.diff(offsets)
        if len(self.lengths) == 0:
            raise ValueError("the dataset is empty: nothing to pack")
        self.bin_ids = pack_lengths(self.lengths, self.pack_len, algorithm, seed)  # errors name a too-long sample
        order, self.pack_offsets = group_by_pack(self.bin_ids)
        self.tokens, self.seq_offsets = gather_segments(self.tokens, offsets, order)
        self.labels, _ = gather_segments(self.labels, offsets, order)
        self.labels[self.seq_offsets[:-1]] = IGNORE_INDEX  # first token of every sample is never a target
        self.order = order

    def __len__(self) -> int:
        return len(self.pack_offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {len(self)} packs")
        i %= len(self)
        bounds = self.seq_offsets[self.pack_offsets[i] : self.pack_offsets[i + 1] + 1]
        lo, hi = int(bounds[0]), int(bounds[-1])
        return {
            "input_ids": torch.as_tensor(self.tokens[lo:hi], dtype=torch.long),
            "labels": torch.as_tensor(self.labels[lo:hi], dtype=torch.long),
            "position_ids": torch.from_numpy(_positions(np.diff(bounds))),
        }

    def collate(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Flatten a batch of packs into ONE model-ready row ``[1, T]`` with boundaries (any batch size)."""
        if not batch:
            raise ValueError("empty batch")
        items = [_pack_item(item) for item in batch]
        lengths = np.concatenate([item[2] for item in items])
        pieces = {"input_ids": [item[0] for item in items], "labels": [item[1] for item in items]}
        total = int(lengths.sum())
        fill = -total % self.pad_to_multiple_of
        if fill:  # one trailing segment of padding, never a target
            pieces["input_ids"].append(torch.full((fill,), self.pad_token_id, dtype=torch.long))
            pieces["labels"].append(torch.full((fill,), IGNORE_INDEX, dtype=torch.long))
            lengths = np.append(lengths, fill)
        cu = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
        labels = mask_first_labels(torch.cat(pieces["labels"]), cu[:-1])
        max_len = int(lengths.max())
        real = lengths.copy()
        real[len(real) - (1 if fill else 0):] = 0  # the trailing fill is a segment of no sample
        meta = {"cu_seqlens_padded": cu, "cu_seqlens": torch.from_numpy(np.concatenate(([0], np.cumsum(real))).astype(
            np.int32)), "seq_lengths": torch.from_numpy(lengths[:len(lengths) - (1 if fill else 0)].astype(np.int32))}
        return {
            "input_ids": torch.cat(pieces["input_ids"]).unsqueeze(0),
            "labels": labels.unsqueeze(0),
            "position_ids": torch.from_numpy(_positions(lengths)).unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_len,
            "max_length_k": max_len,
            METADATA_KEY: meta,
        }

    def stat(self) -> dict[str, float]:
        """Print and return sample/pack counts before and after packing, and the packing efficiency."""
        stats = packing_stats(self.lengths, self.bin_ids, self.pack_len)
        real = int(self.lengths.sum())
        padded_slots = len(self.lengths) * int(self.lengths.max())
        report = {
            "samples": stats.num_samples,
            "packs": stats.num_packs,
            "tokens": real,
            "packing_factor": stats.packing_factor,
            "efficiency": stats.packing_efficiency,
            "padded_efficiency": 100.0 * real / padded_slots,
        }
        print(
            f"PackedDataset ({self.algorithm}, pack_len={self.pack_len}): before {stats.num_samples} samples, "
            f"{real} tokens ({report['padded_efficiency']:.1f}% of {padded_slots} slots when padded to the longest "
            f"sample {int(self.lengths.max())}); after {stats.num_packs} packs, n = {stats.packing_factor:.2f} "
            f"samples/pack, efficiency {stats.packing_efficiency:.2f}%"
        )
        return report


def _positions(lengths: np.ndarray) -> np.ndarray:
    """Position ids restarting at 0 for every sample: ``[2, 3] -> [0, 1, 0, 1, 2]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _pack_item(item: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(input_ids [T], labels [T], sample lengths)`` of one pack item; lengths from ``seq_lengths`` or from where
    ``position_ids`` restart at 0. Raises if neither is there or the lengths do not cover the pack."""
    tokens = torch.as_tensor(np.asarray(item["input_ids"]), dtype=torch.long).reshape(-1)
    labels = torch.tensor(np.asarray(item.get("labels", item["input_ids"])), dtype=torch.long).reshape(-1)  # a copy
    if item.get("seq_lengths") is not None:
        lengths = np.asarray(item["seq_lengths"], dtype=np.int64).reshape(-1)
    elif item.get("position_ids") is not None:
        positions = np.asarray(item["position_ids"]).reshape(-1)
        starts = np.flatnonzero(positions == 0)
        if positions.size and (starts.size == 0 or starts[0] != 0):
            raise ValueError("pack item: position_ids must start at 0 and restart at 0 for every sample")
        lengths = np.diff(np.append(starts, positions.size))
    else:
        raise ValueError(
            f"pack item has neither 'position_ids' nor 'seq_lengths' (keys: {sorted(item)}), so its sample boundaries "
            "are lost; if a Trainer removed them (remove_unused_columns), pass the vlm_pack dataset itself to "
            "Trainer and its to_hf_dataset(...) view to TRL"
        )
    if int(lengths.sum()) != tokens.numel() or labels.numel() != tokens.numel():
        raise ValueError(
            f"pack item holds {tokens.numel()} input_ids, {labels.numel()} labels but its samples add up to "
            f"{int(lengths.sum())} tokens: the pack was cut (TRL truncates to max_length unless "
            "SFTConfig(dataset_kwargs={'skip_prepare_dataset': True}))"
        )
    return tokens, labels, lengths


def _list_column(dataset, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and offsets of a list column: Arrow fast path for ``datasets.Dataset``, else row by row."""
    if hasattr(dataset, "data") and hasattr(dataset, "flatten_indices"):
        from .prepare import flat_list_column

        if getattr(dataset, "_indices", None) is not None:  # a shuffled/selected view: materialise its rows
            dataset = dataset.flatten_indices()
        if name not in dataset.column_names:
            raise ValueError(f"dataset has no {name!r} column (columns: {dataset.column_names}); tokenise it first")
        values, lengths = flat_list_column(dataset, name, np.int64)
    else:
        rows = [np.asarray(r[name], dtype=np.int64).reshape(-1) for r in dataset]
        lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
        values = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return values, np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
