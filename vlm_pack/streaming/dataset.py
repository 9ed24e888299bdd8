"""``StreamingPackDataset``: token-budget packs built on the fly from a dataset that only streams.

Per epoch the source's shards (files of ``load_dataset(..., streaming=True)``) are put in an order drawn from
``(seed, epoch)`` and dealt to the data-parallel ranks and DataLoader workers BEFORE packing (unit =
``rank * workers + worker``), so every sample is read by exactly one unit, at any shard count (:func:`deal`):
whole shards while every unit gets one more (shard ``i`` of the order to unit ``i % units``, as
``datasets.distributed.split_dataset_by_node`` deals a divisible count), and the ``n_shards % units`` shards left
over (all of them when there are fewer shards than units) split by example: every unit reads them and keeps every
``units``-th row, so one big file trains on any number of ranks and workers. Each unit measures its samples with
the token-budget planner's exact counts (``measure_lengths``: chat template and tokenizer, images from their
headers), packs them with :class:`BufferedBestFit` (bounded look-ahead) and collates every pack on the spot: one
packed row per item, micro-batch 1, like ``TokenBudgetPackDataset``.

Every item carries, under ``batch["vlm_pack"]["stream"]``, its unit, the samples it holds (``[shard, row]``), their
lengths and the unit's state after it: the read cursor (position in the unit's read list, next row) and the waiting
samples' keys and lengths. Restoring that state (:meth:`StreamingPackDataset.load_state_dict`) re-reads only the
window between the oldest waiting sample and the cursor (a bounded one: no sample waits more than ``buffer_size``
packs), never the stream from its start, and the packs that follow equal an uninterrupted run's. A saved state
carries the dataset's :meth:`~StreamingPackDataset.fingerprint` (source files and sizes, seed, pack and buffer
size, collator settings, world size, workers): a resume with any of them changed is refused, naming the setting
and both values.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..budget.lengths import measure_lengths
from ..core.batch import METADATA_KEY, packing_metadata
from .packer import STATE_FORMAT, BufferedBestFit, Key

__all__ = ["StreamingPackDataset", "deal"]

logger = logging.getLogger(__name__)


def _default_layout() -> tuple[int, int]:
    """(rank, world size) of the data-parallel group, from torch.distributed or torchrun's variables."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def deal(order: list[int], units: int) -> list[list[list[int]]]:
    """Every unit's read list for shards in ``order``: ``[shard, stride, offset]`` parts, rows ``r`` with
    ``r % stride == offset`` kept. Whole shards first (``order[u::units]`` up to the last full round), then each
    left-over shard ``j`` split by example (stride ``units``, offset ``(u + j) % units``, rotating so that short
    shards do not always favour the same units): every row of every shard goes to exactly one unit."""
    whole = len(order) - len(order) % units
    return [[[shard, 1, 0] for shard in order[unit:whole:units]]
            + [[shard, units, (unit + j) % units] for j, shard in enumerate(order[whole:])]
            for unit in range(units)]


def _describe_deal(shards: int, units: int) -> str:
    whole, left = divmod(shards, units)
    parts = [f"{whole} whole shard(s) per unit"] if whole else []
    if left:
        parts.append(f"{left} shard(s) split by example (every unit reads them and keeps every {units}-th row)")
    return f"streaming packs: {shards} shards for {units} rank x worker units: " + "; ".join(parts)


def _source_files(source: Any) -> list[str] | None:
    """The file behind each shard of a ``load_dataset(..., streaming=True)`` source (None when not files)."""
    iterable = getattr(source, "_ex_iterable", None)
    while iterable is not None:
        kwargs = getattr(iterable, "kwargs", None) or {}
        files = kwargs.get("original_files") or kwargs.get("base_files")
        if isinstance(files, list) and len(files) == source.n_shards and all(isinstance(f, str) for f in files):
            return files
        iterable = getattr(iterable, "ex_iterable", None)
    return None


def _source_fingerprint(source: Any, files: list[str] | None) -> list:
    """Each shard as ``[file, size in bytes]`` (size None when not a local file), or, for in-memory shards,
    ``[row count, datasets fingerprint]``; the stream's type and shard count when neither is known."""
    if files is not None:
        return [[f, os.path.getsize(f) if os.path.isfile(f) else None] for f in files]
    shards = (getattr(getattr(source, "_ex_iterable", None), "kwargs", None) or {}).get("shards")
    if isinstance(shards, list) and len(shards) == source.n_shards:
        return [[len(s), getattr(s, "_fingerprint", None)] for s in shards]
    return [type(source).__name__, source.n_shards]


def _collator_fingerprint(collator: Any) -> dict:
    """The collator settings that change a sample's length or a pack's layout."""
    processor = getattr(collator, "processor", None)
    template = getattr(collator, "chat_template", None) or ""
    chat = getattr(collator, "chat", None)
    return {
        "class": type(collator).__name__,
        "processor": getattr(processor, "name_or_path", None) or type(processor).__name__,
        "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16],
        "template_kwargs": {k: repr(v) for k, v in sorted(dict(getattr(chat, "kwargs", {}) or {}).items())},
        "family": getattr(getattr(collator, "family", None), "name", None),
        "max_length": collator.max_length,
        "pad_to_multiple_of": collator.pad_to_multiple_of,
        "pad_to_length": getattr(collator, "pad_to_length", None),
    }


class StreamingPackDataset(torch.utils.data.IterableDataset):
    """Packs of at most ``pack_size`` tokens from ``source`` (a sharded ``datasets.IterableDataset`` of chat
    examples, any number of shards) encoded by ``collator`` (a packing ``VLMPackingCollator``, VLM or text).

    ``buffer_size``: samples the look-ahead holds (docs/streaming_packs.md gives the fill per size).
    ``rank`` / ``world_size``: this process's data-parallel place (default: torch.distributed, then torchrun's
    ``RANK`` / ``WORLD_SIZE``). ``fixed_width=True`` pads every row to ``pack_size`` (static shapes).
    Serve at batch size 1 with :meth:`collate_fn`; in ``Trainer`` add :class:`StreamingPackCallback` (equal steps on
    every rank, loss-free packs at an epoch's end, state saved with checkpoints).
    """

    def __init__(self, source: Any, collator: Any, *, pack_size: int, buffer_size: int = 256, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None, fixed_width: bool = False) -> None:
        super().__init__()
        shards = getattr(source, "n_shards", None)
        if not isinstance(shards, int) or shards < 1 or not hasattr(source, "shard"):
            raise ValueError(f"source must be a sharded datasets.IterableDataset (load_dataset(..., streaming=True) or "
                             f"Dataset.to_iterable_dataset(num_shards=...)); got {type(source).__name__}")
        for name, value in (("pack_size", pack_size), ("buffer_size", buffer_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if not collator.pack_sequences_in_batch:
            raise ValueError("the collator must pack (pack_sequences_in_batch=True) to build token-budget packs")
        if collator.max_length < pack_size:
            raise ValueError(f"collator max_length={collator.max_length} < pack_size={pack_size}: raise it")
        default_rank, default_world = _default_layout()
        self.rank = default_rank if rank is None else int(rank)
        self.world_size = default_world if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={self.rank}, world_size={self.world_size}")
        self.source = source
        self.files = _source_files(source)
        self.collator = collator
        if fixed_width:
            self.collator = copy.copy(collator)
            self.collator.pad_to_length = pack_size
        self.pack_size = pack_size
        self.buffer_size = buffer_size
        self.seed = int(seed)
        self.epoch = 0
        self._resume: dict | None = None
        self._fingerprint = {
            "source": _source_fingerprint(source, self.files), "seed": self.seed, "pack_size": pack_size,
            "buffer_size": buffer_size, "collator": _collator_fingerprint(self.collator),
            "world_size": self.world_size,
        }

    # ------------------------------------------------------------------ epochs and state

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration packs (it draws the shard order and the seeded shuffle)."""
        self.epoch = int(epoch)

    def fingerprint(self, workers: int | None = None) -> dict:
        """Everything that shapes the packs: the source's files and sizes, seed, pack and buffer size, the collator's
        settings, the world size and (when given) the DataLoader workers. Saved with every stream state."""
        return {**self._fingerprint, **({} if workers is None else {"dataloader_num_workers": int(workers)})}

    def check_fingerprint(self, saved: dict, workers: int | None = None) -> None:
        """Refuse a saved state made with other settings, naming the first that differs and both values."""
        now = self.fingerprint(workers)
        for name, value in now.items():
            if name not in saved or saved[name] == value:
                continue
            was = saved[name]
            if isinstance(value, dict) and isinstance(was, dict):  # name the setting inside (e.g. the collator's)
                inner = next(k for k in {**was, **value} if was.get(k) != value.get(k))
                name, was, value = f"{name}.{inner}", was.get(inner), value.get(inner)
            elif name == "source" and isinstance(value, list) and isinstance(was, list) and len(value) == len(was):
                inner = next(i for i in range(len(value)) if was[i] != value[i])
                name, was, value = f"source shard {inner}", was[inner], value[inner]
            raise ValueError(f"the saved stream state was made with {name}={was!r}, this run has {name}={value!r}: "
                             "resume with the settings of the run that saved it (or start a new run without "
                             "resume_from_checkpoint)")

    def load_state_dict(self, state: dict, workers: int | None = None) -> None:
        """Continue from ``state`` (``{"format", "fingerprint", "epoch", "units": {unit: unit state}, "last_unit"}``:
        the states the epoch's consumed items carried, and the unit of the last one): the next iteration of that
        epoch resumes each listed unit after its last consumed pack (units not listed start the epoch afresh) and
        the DataLoader's round robin after ``last_unit``. Later epochs are unaffected. A state made with other
        settings (:meth:`fingerprint`; ``workers``: this run's DataLoader workers, checked when given) is refused."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a streaming pack state of this version (format {state.get('format')!r}, expected "
                             f"{STATE_FORMAT!r}): resume from a checkpoint saved by this vlm_pack")
        saved = state["fingerprint"]
        try:
            self.check_fingerprint(saved, workers)
        except ValueError as err:
            if saved.get("pack_size", self.pack_size) > self.pack_size:
                raise ValueError(f"{err}{self._too_long_waiting(state)}") from None
            raise
        last = state.get("last_unit")
        self._resume = {"epoch": int(state["epoch"]), "last_unit": None if last is None else int(last),
                        "units": {int(u): s for u, s in state["units"].items()},
                        "workers": state["fingerprint"].get("dataloader_num_workers")}
        self.epoch = int(state["epoch"])

    def _too_long_waiting(self, state: dict) -> str:
        """The first sample waiting in ``state`` that this run's smaller pack_size could not hold, for messages."""
        for unit_state in state["units"].values():
            for position, row, length, _ in unit_state["packer"]["waiting"]:
                if length > self.pack_size:
                    where = self.where(unit_state["parts"][position][0], row)
                    return f" (e.g. {where}, waiting in the saved state, has {length} tokens)"
        return ""

    def shard_order(self, epoch: int) -> np.ndarray:
        """The source shards in the order epoch ``epoch`` deals them."""
        return np.random.default_rng((self.seed, int(epoch))).permutation(self.source.n_shards)

    def read_lists(self, epoch: int, workers: int) -> list[list[list[int]]]:
        """Every unit's read list in epoch ``epoch`` (:func:`deal`), unit = ``rank * workers + worker``."""
        return deal(self.shard_order(epoch).tolist(), self.world_size * max(workers, 1))

    def describe_deal(self, workers: int) -> str:
        """One line: how the shards are dealt to ``world_size x workers`` units (whole, split by example)."""
        return _describe_deal(self.source.n_shards, self.world_size * max(workers, 1))

    def where(self, shard: int, row: int) -> str:
        """A sample's place for messages: its file and line (JSON lines) or row, else the shard and row."""
        if self.files is None:
            return f"stream shard {shard} row {row}"
        name = self.files[shard]
        line = name.endswith((".jsonl", ".jsonl.gz", ".ndjson"))
        return f"{name} {'line' if line else 'row'} {row + 1 if line else row}"

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        units = self.world_size * workers
        epoch = self.epoch
        resume = None
        resuming = self._resume is not None and self._resume["epoch"] == epoch
        if resuming:
            saved = self._resume["workers"]
            if saved is not None and max(saved, 1) != workers:
                raise ValueError(f"the saved stream state was made with dataloader_num_workers={saved}, this run has "
                                 f"{0 if info is None else workers}: resume with the same number of workers")
            if self._resume["last_unit"] is not None:
                # The DataLoader serves its workers round robin from worker 0, skipping finished ones: start the
                # rotation at the unit after the last consumed one, as the uninterrupted run continues.
                worker = (worker + self._resume["last_unit"] + 1) % workers
        unit = self.rank * workers + worker
        if resuming:
            resume = self._resume["units"].get(unit)
        parts = self.read_lists(epoch, workers)[unit]
        yield from _UnitPacker(self, epoch, unit, units, parts, resume)

    def trainer_callback(self, **kwargs: Any):
        """The :class:`~vlm_pack.streaming.trainer.StreamingPackCallback` for this dataset (``PackedSFTTrainer``
        adds it itself)."""
        from .trainer import StreamingPackCallback

        return StreamingPackCallback(self, **kwargs)

    @staticmethod
    def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
        """DataLoader ``collate_fn`` at batch size 1: the pack is the batch."""
        if len(items) != 1:
            raise ValueError(f"streaming packs are served at micro-batch size 1 (a pack is the batch); got "
                             f"{len(items)} items: set batch_size=1 (per_device_train_batch_size=1)")
        return items[0]


class _UnitPacker:
    """One unit's packs for one epoch, from the start or from a saved unit state."""

    def __init__(self, owner: StreamingPackDataset, epoch: int, unit: int, units: int, parts: list[list[int]],
                 resume: dict | None) -> None:
        self.owner, self.epoch, self.unit, self.units, self.parts = owner, epoch, unit, units, parts
        self.align = owner.collator.pad_to_multiple_of
        self.packer = BufferedBestFit(owner.pack_size, owner.buffer_size, (owner.seed, epoch, unit))
        self.examples: dict[Key, Any] = {}
        self.cursor: Key = (0, 0)
        if resume is not None:
            if resume["parts"] != parts:
                raise ValueError(f"unit {unit}: the saved state read {resume['parts']}, this run {parts}: resume with "
                                 "the same source, seed, world size and workers")
            self.packer.load_state_dict(resume["packer"])
            self.cursor = tuple(resume["cursor"])
            self._reread_waiting()
        self.rows = self._read(self.cursor)

    def _read(self, start: Key) -> Iterator[tuple[Key, Any]]:
        """``((position in the read list, row), example)`` from ``start`` on: the unit's rows of its parts, in order."""
        position, row = start
        source = self.owner.source
        for position in range(position, len(self.parts)):
            shard_id, stride, offset = self.parts[position]
            shard = source.shard(num_shards=source.n_shards, index=shard_id)
            if row:
                shard = shard.skip(row)
            # iter(), not iteration: inside a DataLoader worker, datasets would split the shard among the workers
            at = row
            for batch in shard.iter(batch_size=64):
                for values in zip(*batch.values()):
                    if at % stride == offset:
                        yield (position, at), dict(zip(batch, values))
                    at += 1
            row = 0

    def _reread_waiting(self) -> None:
        """Read the waiting samples back: the window from the oldest of them up to the cursor."""
        wanted = {sample.key for sample in self.packer.waiting()}
        if not wanted:
            return
        for key, example in self._read(min(wanted)):
            if key >= self.cursor:
                break
            if key in wanted:
                self.examples[key] = example
        if len(self.examples) != len(wanted):
            raise ValueError(f"unit {self.unit}: {len(wanted) - len(self.examples)} waiting samples of the saved state "
                             "are not in the stream any more: the source changed since the checkpoint")

    def _refill(self) -> None:
        """Read until the buffer is full or the unit's shards end; measure the new samples together."""
        keys, examples = [], []
        while len(self.packer) + len(keys) < self.owner.buffer_size:
            try:
                key, example = next(self.rows)
            except StopIteration:
                self.cursor = (len(self.parts), 0)
                break
            keys.append(key)
            examples.append(example)
            self.cursor = (key[0], key[1] + 1)
        if not keys:
            return
        try:
            lengths = measure_lengths(examples, self.owner.collator, batch_size=len(examples), progress=False).tokens
        except ValueError as err:
            for key, example in zip(keys, examples):  # the error path only: find the sample, alone
                try:
                    measure_lengths([example], self.owner.collator, progress=False)
                except ValueError as alone:
                    raise ValueError(f"{self._where(key)}: {alone}") from alone
            raise ValueError(f"{self._where(keys[0])} (or one of the {len(keys)} samples read with it): {err}") from err
        for key, example, length in zip(keys, examples, lengths.tolist()):
            aligned = -(-length // self.align) * self.align
            if aligned > self.owner.pack_size:
                media = any(example.get(name) for name in ("images", "videos"))
                fix = "raise pack_size or shrink its images" if media else "raise pack_size"
                raise ValueError(f"{self._where(key)} has {length} tokens{' (images expanded)' if media else ''}, "
                                 f"more than pack_size={self.owner.pack_size}: {fix} (samples are never cut)")
            self.examples[key] = example
            self.packer.add(key, aligned)

    def _where(self, key: Key) -> str:
        return self.owner.where(self.parts[key[0]][0], key[1])

    def state(self) -> dict:
        return {"epoch": self.epoch, "unit": self.unit, "units": self.units, "parts": self.parts,
                "cursor": list(self.cursor), "packer": self.packer.state_dict()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            self._refill()
            if not len(self.packer):
                return
            pack = self.packer.cut()
            chosen = [self.examples.pop(sample.key) for sample in pack]
            try:
                batch = self.owner.collator(chosen)
            except Exception as err:
                raise ValueError(f"pack of {[self._where(s.key) for s in pack]}: {err}") from err
            real = torch.diff(packing_metadata(batch)["cu_seqlens"]).tolist()
            for sample, got in zip(pack, real):
                if -(-got // self.align) * self.align != sample.length:
                    raise ValueError(f"{self._where(sample.key)} has {got} tokens but was measured at {sample.length}: "
                                     "the collator encodes it differently from measure_lengths (please report)")
            batch[METADATA_KEY]["stream"] = {
                "unit": self.unit, "epoch": self.epoch,
                "samples": [[self.parts[s.key[0]][0], s.key[1]] for s in pack],
                "lengths": [s.length for s in pack],
                "state": self.state(),
            }
            yield batch
