"""``StreamingPackDataset``: token-budget packs built on the fly from a dataset that only streams.

Per epoch the source's shards (files of ``load_dataset(..., streaming=True)``) are put in an order drawn from
``(seed, epoch)`` and dealt to the data-parallel ranks and DataLoader workers BEFORE packing (shard ``i`` of the
order goes to unit ``i % units``, unit = ``rank * workers + worker``), so every sample is read by exactly one
unit. Each unit measures its samples with the token-budget planner's exact counts (``measure_lengths``: chat
template and tokenizer, images from their headers), packs them with :class:`BufferedBestFit` (bounded
look-ahead) and collates every pack on the spot: one packed row per item, micro-batch 1, like
``TokenBudgetPackDataset``.

Every item carries, under ``batch["vlm_pack"]["stream"]``, its unit, the samples it holds (``[shard, row]``) and
the unit's state after it: the read cursor (position in the epoch's shard list, next row) and the waiting samples'
keys and lengths. Restoring that state (:meth:`load_state_dict`) re-reads only the window between the oldest
waiting sample and the cursor (a bounded one: no sample waits more than ``buffer_size`` packs), never the stream
from its start, and the packs that follow equal an uninterrupted run's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..budget.lengths import measure_lengths
from ..core.batch import METADATA_KEY, packing_metadata
from .packer import BufferedBestFit, Key

__all__ = ["StreamingPackDataset"]

_FORMAT = "vlm_pack.stream_state/1"


def _default_layout() -> tuple[int, int]:
    """(rank, world size) of the data-parallel group, from torch.distributed or torchrun's variables."""
    import os

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class StreamingPackDataset(torch.utils.data.IterableDataset):
    """Packs of at most ``pack_size`` tokens from ``source`` (a sharded ``datasets.IterableDataset`` of chat
    examples) encoded by ``collator`` (a packing ``VLMPackingCollator``, VLM or text).

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
        if not isinstance(shards, int) or not hasattr(source, "shard"):
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
        self.collator = collator
        if fixed_width:
            self.collator = copy.copy(collator)
            self.collator.pad_to_length = pack_size
        self.pack_size = pack_size
        self.buffer_size = buffer_size
        self.seed = int(seed)
        self.epoch = 0
        self._resume: dict | None = None

    # ------------------------------------------------------------------ epochs and state

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration packs (it draws the shard order and the seeded shuffle)."""
        self.epoch = int(epoch)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (``{"format", "epoch", "units": {unit: unit state}, "last_unit"}``: the states the
        epoch's consumed items carried, and the unit of the last one): the next iteration of that epoch resumes each
        listed unit after its last consumed pack (units not listed start the epoch afresh) and the DataLoader's
        round robin after ``last_unit``. Later epochs are unaffected. The number of DataLoader workers must not
        change."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a streaming pack state (format {state.get('format')!r}, expected {_FORMAT!r})")
        last = state.get("last_unit")
        self._resume = {"epoch": int(state["epoch"]), "last_unit": None if last is None else int(last),
                        "units": {int(u): s for u, s in state["units"].items()}}
        self.epoch = int(state["epoch"])

    def shard_order(self, epoch: int) -> np.ndarray:
        """The source shards in the order epoch ``epoch`` deals them."""
        return np.random.default_rng((self.seed, int(epoch))).permutation(self.source.n_shards)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        units = self.world_size * workers
        if self.source.n_shards < units:
            raise ValueError(
                f"the stream has {self.source.n_shards} shards for {self.world_size} ranks x {workers} DataLoader "
                "workers: every worker of every rank needs at least one shard (shards are dealt before packing, so "
                "no sample is read twice). Write more, smaller files, or use fewer workers"
            )
        epoch = self.epoch
        resume = None
        resuming = self._resume is not None and self._resume["epoch"] == epoch
        if resuming and self._resume["last_unit"] is not None:
            # The DataLoader serves its workers round robin from worker 0, skipping finished ones: start the
            # rotation at the unit after the last consumed one, as the uninterrupted run continues.
            worker = (worker + self._resume["last_unit"] + 1) % workers
        unit = self.rank * workers + worker
        if resuming:
            resume = self._resume["units"].get(unit)
            if resume is not None and resume["units"] != units:
                raise ValueError(f"the saved stream state was made with {resume['units']} ranks x workers, now "
                                 f"{units}: resume with the same world size and dataloader_num_workers")
        shards = self.shard_order(epoch)[unit::units].tolist()
        yield from _UnitPacker(self, epoch, unit, units, shards, resume)

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

    def __init__(self, owner: StreamingPackDataset, epoch: int, unit: int, units: int, shards: list[int],
                 resume: dict | None) -> None:
        self.owner, self.epoch, self.unit, self.units, self.shards = owner, epoch, unit, units, shards
        self.align = owner.collator.pad_to_multiple_of
        self.packer = BufferedBestFit(owner.pack_size, owner.buffer_size, (owner.seed, epoch, unit))
        self.examples: dict[Key, Any] = {}
        self.cursor: Key = (0, 0)
        if resume is not None:
            if resume["shards"] != shards:
                raise ValueError(f"unit {unit}: the saved state was dealt shards {resume['shards']}, this run "
                                 f"{shards}: resume with the same source, seed, world size and workers")
            self.packer.load_state_dict(resume["packer"])
            self.cursor = tuple(resume["cursor"])
            self._reread_waiting()
        self.rows = self._read(self.cursor)

    def _read(self, start: Key) -> Iterator[tuple[Key, Any]]:
        """``((shard position, row), example)`` from ``start`` on, through the unit's shards in order."""
        position, row = start
        for position in range(position, len(self.shards)):
            shard = self.owner.source.shard(num_shards=self.owner.source.n_shards, index=self.shards[position])
            if row:
                shard = shard.skip(row)
            # iter(), not iteration: inside a DataLoader worker, datasets would split the shard among the workers
            offset = row
            for batch in shard.iter(batch_size=64):
                for values in zip(*batch.values()):
                    yield (position, offset), dict(zip(batch, values))
                    offset += 1
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
                self.cursor = (len(self.shards), 0)
                break
            keys.append(key)
            examples.append(example)
            self.cursor = (key[0], key[1] + 1)
        if not keys:
            return
        try:
            lengths = measure_lengths(examples, self.owner.collator, batch_size=len(examples), progress=False).tokens
        except ValueError as err:
            raise ValueError(f"{self._where(keys[0])} (or one of the {len(keys)} samples read with it): {err}") from err
        for key, example, length in zip(keys, examples, lengths.tolist()):
            aligned = -(-length // self.align) * self.align
            if aligned > self.owner.pack_size:
                raise ValueError(f"{self._where(key)} has {length} tokens (images expanded), more than pack_size="
                                 f"{self.owner.pack_size}; raise pack_size or shrink images: samples are never cut")
            self.examples[key] = example
            self.packer.add(key, aligned)

    def _where(self, key: Key) -> str:
        return f"stream shard {self.shards[key[0]]} row {key[1]}"

    def state(self) -> dict:
        return {"format": _FORMAT, "epoch": self.epoch, "unit": self.unit, "units": self.units,
                "shards": self.shards, "cursor": list(self.cursor), "packer": self.packer.state_dict()}

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
                "samples": [[self.shards[s.key[0]], s.key[1]] for s in pack],
                "state": self.state(),
            }
            yield batch
