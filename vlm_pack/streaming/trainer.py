"""``StreamingPackCallback``: a ``StreamingPackDataset`` in ``Trainer`` / TRL, exactly once per epoch, resumable.

What a stream needs from the training loop and how this callback provides it:

* **No re-sharding.** accelerate wraps every ``IterableDataset`` in ``IterableDatasetShard`` at several ranks, which
  keeps one item in ``world_size`` and pads the end with the first items. The dataset already deals shards per rank,
  so the wrapper is made a pass-through (``num_processes=1``), as transformers does for its own rank-aware
  ``BatchRebalanceSampler``.
* **Equal steps.** Ranks pack different data, so their epochs end after different numbers of packs. The prepared
  train dataloader is made to agree on every pull (one tiny all-reduce, on a gloo group, per micro-batch): a rank
  whose data pipeline raised still joins that pull with an error flag, so every rank stops with an error at the same
  pull instead of waiting for it; a rank whose epoch is over gets a loss-free pack (a one-sample text pack with
  every label -100: no token counts in ``num_items_in_batch``, so gradients and the loss are those of the real
  packs) until every rank is done, then all ranks pad to a multiple of ``gradient_accumulation_steps``. No sample is
  repeated; every window is whole, so an epoch's last optimizer step is not mixed into the next epoch's first.
* **Resume that follows the checkpoint.** The dataloader records the stream state carried by every pack it hands
  over. The callback is a ``transformers`` ``ExportableState``: at the end of a step that saves, the ranks' states
  are gathered (one small ``all_gather_object``) and rank 0's ``trainer_state.json`` stores them under
  ``stateful_callbacks`` with each checkpoint. Trainer reads that file back from whatever folder
  ``train(resume_from_checkpoint=...)`` names (a copied or moved checkpoint included), and ``on_train_begin`` of the
  resumed run restores every rank's stream from it, after checking its fingerprint (the settings that shape the
  packs). ``ignore_data_skip=True`` is required: Trainer's own skip re-reads the stream from its start.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.batch import METADATA_KEY
from ..core.packing import IGNORE_INDEX
from .packer import STATE_FORMAT, predict_fill

if TYPE_CHECKING:  # the dataset module imports this one (StreamingPackDataset.trainer_callback), never the reverse
    from .dataset import StreamingPackDataset

__all__ = ["StreamingPackCallback", "StreamAligner"]

logger = logging.getLogger(__name__)
_DONE, _DATA, _FAILED = 0, 1, 2  # what a rank reports at a pull (a failure as _FAILED + its rank); the max wins
FILL_WARNING = 0.9  # warn when the buffer's predicted fill is under this fraction of offline best fit's
FILL_SAMPLES = 32  # lengths the prediction starts from (or all of the first epoch's, when it has fewer)
_PAD_EXAMPLE = {"messages": [{"role": "user", "content": "pad"}, {"role": "assistant", "content": "pad"}]}


def _is_stream(obj: Any) -> bool:
    """A ``StreamingPackDataset``, known by its ``trainer_callback`` (as ``PackedSFTTrainer`` knows it)."""
    return callable(getattr(obj, "trainer_callback", None))


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
    ``sync(code) -> the largest code of all ranks``: the cross-rank agreement (identity at one rank).
    ``workers``: the DataLoader's workers (saved in the state's fingerprint and checked on restore; the deal of the
    shards to the units is logged once when given).
    """

    def __init__(self, dataset: StreamingPackDataset, multiple: int, pad: dict[str, Any], sync=None,
                 workers: int | None = None) -> None:
        self.dataset, self.multiple, self.pad, self.workers = dataset, multiple, pad, workers
        self.sync = sync or (lambda code: code)
        self.epoch, self.pulled = 0, 0  # the epoch wrap() pulls next / packs it pulled in its current epoch
        self.pending: deque[tuple[int, int | None, dict | None]] = deque()
        self.consumed_epoch, self.count, self.units, self.last_unit = 0, 0, {}, None
        self.pads = 0
        self.fill_checked = dataset.rank != 0  # rank 0 predicts the fill from its first samples' lengths
        self.fill_lengths: list[int] = []
        if workers is not None and dataset.rank == 0:
            split = dataset.source.n_shards % (dataset.world_size * max(workers, 1))
            (logger.warning if split else logger.info)(dataset.describe_deal(workers))

    def state(self) -> dict:
        return {"format": STATE_FORMAT, "fingerprint": self.dataset.fingerprint(self.workers), "epoch": self.consumed_epoch,
                "count": self.count, "units": self.units, "last_unit": self.last_unit}

    def restore(self, state: dict) -> None:
        self.dataset.load_state_dict(state, self.workers)
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

    def _pull(self, next_batch) -> tuple[dict[str, Any] | None, bool]:
        """(the rank's next pack or None at its epoch's end, whether every rank's epoch is over), agreed with every
        rank: if any rank's pipeline raised, every rank raises here, at the same pull (the failing one its own
        error), instead of waiting in a collective the failing rank never joins."""
        try:
            batch = next_batch()
        except Exception:
            self.sync(_FAILED + self.dataset.rank)
            raise
        code = self.sync(_DATA if batch is not None else _DONE)
        if code >= _FAILED:
            raise RuntimeError(f"rank {code - _FAILED} failed reading its streaming packs (its error is in its log); "
                               f"rank {self.dataset.rank} stops at the same pull instead of waiting for it")
        if batch is not None and not self.fill_checked:
            stream = batch[METADATA_KEY]["stream"]
            self.fill_lengths += stream["lengths"]
            known = self.fill_lengths + [waiting[2] for waiting in stream["state"]["packer"]["waiting"]]
            if len(known) >= FILL_SAMPLES:
                self._check_fill(known)
        return batch, code == _DONE

    def _check_fill(self, lengths: list[int]) -> None:
        """Warn when ``buffer_size`` is too small to fill packs: the fill buffered best fit reaches on lengths like
        the stream's first ones (:func:`predict_fill`), beside offline best fit's."""
        self.fill_checked = True
        pack, buffer = self.dataset.pack_size, self.dataset.buffer_size
        fill, best = predict_fill(lengths, pack, buffer)
        if fill < FILL_WARNING * best:
            per_pack = pack / (sum(lengths) / len(lengths))
            logger.warning(f"buffer_size={buffer} is too small to pack: packs of {pack} tokens hold ~{per_pack:.1f} "
                           f"samples, predicted fill {fill:.2f} (offline best fit {best:.2f}); a buffer of "
                           f"{max(8, round(8 * per_pack))}-{max(16, round(16 * per_pack))} samples fills within ~2% "
                           "of it (docs/streaming_packs.md)")

    def wrap(self, start) -> Any:
        """One epoch's pulls: the rank's packs (``start()`` begins their iteration) plus loss-free packs."""
        batches = None

        def next_batch():
            nonlocal batches
            if batches is None:
                batches = iter(start())
            return next(batches, None)

        everyone_done = False
        while True:
            batch = None
            if not everyone_done:
                batch, everyone_done = self._pull(next_batch)
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
        if not self.fill_checked and self.fill_lengths:
            self._check_fill(self.fill_lengths)
        self.epoch, self.pulled = self.epoch + 1, 0

    def epoch_batches(self, start) -> Any:
        """The next epoch through :meth:`wrap`; ``start()`` begins the loader's iteration, after the dataset's epoch
        is set (its workers copy the dataset when they start). An epoch restored at its very end has nothing left:
        the following epoch runs in the same iteration (Trainer stops training on an empty one)."""
        for _ in range(2):
            self.dataset.set_epoch(self.epoch)
            pulled = 0
            for batch in self.wrap(start):
                pulled += 1
                yield batch
            if pulled:
                return


def _gloo_sync(group):
    def sync(code: int) -> int:
        flag = torch.tensor([int(code)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(flag.item())

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


class StreamingPackCallback(TrainerCallback, ExportableState):
    """Add to ``Trainer(callbacks=[...])`` with a :class:`StreamingPackDataset` as ``train_dataset`` (module doc).

    ``dataset``: the dataset trained on (checked); without it the callback takes the Trainer's train dataset.
    ``stream_state``: every rank's stream state gathered at the last step end that saves, what the checkpoint stores
    in its ``trainer_state.json`` (an ``ExportableState``; Trainer calls :meth:`state` when it saves).
    """

    def __init__(self, dataset: StreamingPackDataset | None = None) -> None:
        if dataset is not None and not _is_stream(dataset):
            raise ValueError(f"StreamingPackCallback takes the StreamingPackDataset you train on; got "
                             f"{type(dataset).__name__}")
        self.dataset = dataset
        self.aligner: StreamAligner | None = None
        self.stream_state: dict | None = None
        self._group = None

    def state(self) -> dict:
        # no "args": Trainer's restore_callback_states_from_checkpoint rebuilds the callback without arguments
        return {"args": {}, "attributes": {"stream_state": self._current()}}

    def _current(self) -> dict | None:
        """Every rank's stream state now (rank 0 calls this when Trainer saves): its own at one rank, else the one
        gathered at this step's end; None (a resume from this checkpoint is refused, never wrong) if no gather
        happened at this step, e.g. a save another callback asked for after this one ran."""
        if self.aligner is None:
            return self.stream_state
        mine = self.aligner.state()
        if self._group is None:
            return {"ranks": [mine]}
        if self.stream_state is not None and self.stream_state["ranks"][self.dataset.rank] == mine:
            return self.stream_state
        return None

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
        shard_wrapper = not _is_stream(inner) and _is_stream(getattr(inner, "dataset", None))
        dataset = inner.dataset if shard_wrapper else inner
        if not _is_stream(dataset) or (self.dataset is not None and self.dataset is not dataset):
            raise ValueError("StreamingPackCallback: the Trainer's train_dataset is not the callback's "
                             "StreamingPackDataset")
        self.dataset = dataset
        if shard_wrapper:
            inner.num_processes, inner.process_index = 1, 0  # accelerate's IterableDatasetShard: pass-through
        sync = None
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            self._group = torch.distributed.new_group(backend="gloo")
            sync = _gloo_sync(self._group)
        pad = loss_free_pack(dataset)
        device = getattr(loader, "device", None)
        if device is not None:
            from accelerate.utils import send_to_device

            pad = send_to_device(pad, device)
        self.aligner = StreamAligner(dataset, args.gradient_accumulation_steps, pad, sync, args.dataloader_num_workers)
        if state.global_step > 0:
            self.aligner.restore(self._saved(state))
        self.stream_state = None
        _install(loader, self.aligner)

    def _saved(self, state) -> dict:
        """This rank's stream state from the checkpoint Trainer resumed (its trainer_state.json)."""
        entry = state.stateful_callbacks.get(type(self).__name__) or {}
        saved = (entry.get("attributes") or {}).get("stream_state") if isinstance(entry, dict) else None
        if not saved:
            raise ValueError(
                f"resuming at step {state.global_step} from a checkpoint whose trainer_state.json holds no stream "
                f"state (stateful_callbacks.{type(self).__name__}): the stream position is unknown (restarting the "
                "stream would repeat and skip samples); resume from a checkpoint saved with StreamingPackCallback")
        ranks = saved["ranks"]
        if len(ranks) != self.dataset.world_size:
            raise ValueError(f"the saved stream state was made with world_size={len(ranks)}, this run has "
                             f"world_size={self.dataset.world_size}: resume with the same number of ranks")
        return ranks[self.dataset.rank]

    def on_step_end(self, args, state, control, **kwargs):
        # DefaultFlowCallback (the first callback) has decided on this step's save; a "best" save is decided after
        # the evaluation, so gather whenever one is due
        if control.should_save or (control.should_evaluate and args.save_strategy == "best"):
            self._gather()

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._gather()

    def _gather(self) -> None:
        """Every rank's state to every rank (one small all_gather_object), for the checkpoint about to be saved."""
        if self._group is None:
            return
        gathered = [None] * torch.distributed.get_world_size(self._group)
        torch.distributed.all_gather_object(gathered, (self.dataset.rank, self.aligner.state()), group=self._group)
        self.stream_state = {"ranks": [rank_state for _, rank_state in sorted(gathered, key=lambda x: x[0])]}
