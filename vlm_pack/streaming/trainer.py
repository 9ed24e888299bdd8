"""``StreamingPackCallback``: a ``StreamingPackDataset`` in ``Trainer`` / TRL, exactly once per epoch, resumable.

What a stream needs from the training loop and how this callback provides it:

* **No re-sharding.** accelerate wraps every ``IterableDataset`` in ``IterableDatasetShard`` at several ranks, which
  keeps one item in ``world_size`` and pads the end with the first items. The dataset already deals shards per rank,
  so the wrapper is made a pass-through (``num_processes=1``), as transformers does for its own rank-aware
  ``BatchRebalanceSampler``.
* **Equal steps.** Ranks pack different data, so their epochs end after different numbers of packs. The prepared
  train dataloader is made to agree on every pull (one tiny all-reduce, on a gloo group, per micro-batch): a rank
  whose epoch is over gets a loss-free pack (a one-sample text pack with every label -100: no token counts in
  ``num_items_in_batch``, so gradients and the loss are those of the real packs) until every rank is done, then all
  ranks pad to a multiple of ``gradient_accumulation_steps``. No sample is repeated; every window is whole, so an
  epoch's last optimizer step is not mixed into the next epoch's first.
* **Resume.** The dataloader records the stream state carried by every pack it hands over; ``on_save`` writes this
  rank's latest per-unit states (``vlm_pack_stream/rank<r>.json`` in the checkpoint), ``on_train_begin`` of a resumed
  run reads them back. ``ignore_data_skip=True`` is required: Trainer's own skip re-reads the stream from its start.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..core.batch import METADATA_KEY
from ..core.packing import IGNORE_INDEX
from .dataset import _FORMAT, StreamingPackDataset

__all__ = ["StreamingPackCallback", "StreamAligner"]

STATE_DIR = "vlm_pack_stream"
_PAD_EXAMPLE = {"messages": [{"role": "user", "content": "pad"}, {"role": "assistant", "content": "pad"}]}


def loss_free_pack(dataset: StreamingPackDataset) -> dict[str, Any]:
    """A one-sample text pack with every label -100 (what a rank whose epoch is over trains on: nothing)."""
    batch = dataset.collator([_PAD_EXAMPLE])
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    batch[METADATA_KEY] = {"stream": {"pad": True}}
    return batch


class StreamAligner:
    """Main-process side of the stream: epochs, equal pulls on every rank, the consumed state (see module doc).

    :meth:`wrap` runs where the packs are pulled (ahead of use: accelerate looks one batch ahead); :meth:`consume`
    is called once per pack handed to the training step, in order, and is what :meth:`state` reports.
    ``sync(has_data) -> any rank has data``: the cross-rank agreement (identity at one rank).
    """

    def __init__(self, dataset: StreamingPackDataset, multiple: int, pad: dict[str, Any], sync=None) -> None:
        self.dataset, self.multiple, self.pad = dataset, multiple, pad
        self.sync = sync or (lambda has_data: has_data)
        self.epoch, self.pulled = 0, 0  # the epoch wrap() pulls next / packs it pulled in its current epoch
        self.pending: deque[tuple[int, int | None, dict | None]] = deque()
        self.consumed_epoch, self.count, self.units, self.last_unit = 0, 0, {}, None
        self.pads = 0

    def state(self) -> dict:
        return {"format": _FORMAT, "epoch": self.consumed_epoch, "count": self.count, "units": self.units,
                "last_unit": self.last_unit}

    def restore(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        self.epoch = self.consumed_epoch = int(state["epoch"])
        self.pulled = self.count = int(state["count"])
        self.units = {int(u): s for u, s in state["units"].items()}
        self.last_unit = state.get("last_unit")

    def consume(self) -> None:
        epoch, unit, unit_state = self.pending.popleft()
        if epoch != self.consumed_epoch:
            self.consumed_epoch, self.count, self.units, self.last_unit = epoch, 0, {}, None
        self.count += 1
        if unit is not None:
            self.units[unit] = unit_state
            self.last_unit = unit

    def wrap(self, batches) -> Any:
        """One epoch's pulls: ``batches`` (the rank's packs) plus loss-free packs (module doc)."""
        everyone_done = False
        while True:
            batch = None
            if not everyone_done:
                batch = next(batches, None)
                everyone_done = not self.sync(batch is not None)
            if everyone_done and self.pulled % self.multiple == 0:
                break
            if batch is None:
                batch = self.pad
                self.pads += 1
                self.pending.append((self.epoch, None, None))
            else:
                stream = batch[METADATA_KEY]["stream"]
                self.pending.append((self.epoch, int(stream["unit"]), stream["state"]))
            self.pulled += 1
            yield batch
        self.epoch, self.pulled = self.epoch + 1, 0

    def epoch_batches(self, start) -> Any:
        """The next epoch through :meth:`wrap`; ``start()`` begins the loader's iteration, after the dataset's epoch
        is set (its workers copy the dataset when they start). An epoch restored at its very end has nothing left:
        the following epoch runs in the same iteration (Trainer stops training on an empty one)."""
        for _ in range(2):
            self.dataset.set_epoch(self.epoch)
            pulled = 0
            for batch in self.wrap(iter(start())):
                pulled += 1
                yield batch
            if pulled:
                return


def _gloo_sync(group):
    def sync(has_data: bool) -> bool:
        flag = torch.tensor([int(has_data)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())

    return sync


def _install(loader: Any, aligner: StreamAligner) -> None:
    """Route accelerate's prepared ``loader`` through ``aligner``: its inner torch DataLoader's iteration goes
    through :meth:`StreamAligner.wrap`, and its ``_update_state_dict`` (called for every batch it hands over, right
    before handing it, and once more for the last one at the end) marks the oldest pulled pack consumed."""
    base = loader.base_dataloader
    base_class = type(base)
    base.__class__ = type(f"StreamAligned{base_class.__name__}", (base_class,),
                          {"__iter__": lambda self: aligner.epoch_batches(lambda: base_class.__iter__(self))})
    update = loader._update_state_dict

    def _update_state_dict():
        update()
        if not loader.end_of_dataloader:  # the end's repeated call for the last batch
            aligner.consume()

    loader._update_state_dict = _update_state_dict


class StreamingPackCallback(TrainerCallback):
    """Add to ``Trainer(callbacks=[...])`` with a :class:`StreamingPackDataset` as ``train_dataset`` (module doc).

    ``resume_from``: the checkpoint folder to read the stream state from when it is not
    ``<output_dir>/checkpoint-<global step>`` (Trainer's own layout).
    """

    def __init__(self, dataset: StreamingPackDataset, resume_from: str | os.PathLike | None = None) -> None:
        if not isinstance(dataset, StreamingPackDataset):
            raise ValueError(f"StreamingPackCallback takes the StreamingPackDataset you train on; got "
                             f"{type(dataset).__name__}")
        self.dataset = dataset
        self.resume_from = resume_from
        self.aligner: StreamAligner | None = None

    def on_init_end(self, args, state, control, **kwargs):
        problems = []
        if not args.ignore_data_skip:
            problems.append("ignore_data_skip=True (Trainer's own resume skip re-reads the stream from its start; the "
                            "callback restores the stream position instead)")
        if args.per_device_train_batch_size != 1:
            problems.append("per_device_train_batch_size=1 (a pack is the micro-batch)")
        if args.accelerator_config.dispatch_batches:
            problems.append('accelerator_config={"dispatch_batches": False} (each rank reads its own shards)')
        if args.remove_unused_columns:
            problems.append("remove_unused_columns=False (Trainer would strip the packs' keys)")
        if not getattr(args, "dataloader_in_order", True):
            problems.append("dataloader_in_order=True (a resume replays the workers' round robin)")
        if args.dataloader_persistent_workers:
            problems.append("dataloader_persistent_workers=False (persistent workers never see the next epoch)")
        if problems:
            raise ValueError("streaming packs need " + "; ".join(problems))

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        loader = train_dataloader
        inner = getattr(loader, "dataset", None)
        if inner is not self.dataset and getattr(inner, "dataset", None) is self.dataset:
            inner.num_processes, inner.process_index = 1, 0  # accelerate's IterableDatasetShard: pass-through
        elif inner is not self.dataset:
            raise ValueError("StreamingPackCallback: the Trainer's train_dataset is not the callback's dataset")
        sync = None
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            sync = _gloo_sync(torch.distributed.new_group(backend="gloo"))
        pad = loss_free_pack(self.dataset)
        device = getattr(loader, "device", None)
        if device is not None:
            from accelerate.utils import send_to_device

            pad = send_to_device(pad, device)
        self.aligner = StreamAligner(self.dataset, args.gradient_accumulation_steps, pad, sync)
        if state.global_step > 0:
            self.aligner.restore(self._read(args, state))
        _install(loader, self.aligner)

    def _path(self, folder: str | os.PathLike, rank: int) -> Path:
        return Path(folder) / STATE_DIR / f"rank{rank}.json"

    def _read(self, args, state) -> dict:
        folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = self._path(folder, self.dataset.rank)
        if not path.is_file():
            raise ValueError(
                f"resuming at step {state.global_step} but {path} does not exist: the stream position is unknown "
                "(restarting the stream would repeat and skip samples). Pass StreamingPackCallback(dataset, "
                "resume_from=<the checkpoint folder>)"
            )
        return json.loads(path.read_text())

    def on_save(self, args, state, control, **kwargs):
        path = self._path(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), self.dataset.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.aligner.state()))
