"""``BalancedPackingSampler`` inside the Hugging Face ``Trainer``.

Trainer's official route for a rank-aware batch sampler is ``_get_train_sampler`` returning a
``BatchRebalanceSampler``: Trainer then hands it to the DataLoader as ``batch_sampler`` and turns accelerate's
re-sharding into a pass-through. Any other batch sampler is either used as a per-sample sampler (a crash: its
items are lists) or, through ``accelerator.prepare``, re-split over the ranks (half the samples dropped at 2
ranks). :class:`BalancedBatchSampler` is that subclass; :meth:`BalancedBatchSampler.for_trainer` builds it
from the Trainer's arguments::

    class BalancedTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return BalancedBatchSampler.for_trainer(self, lengths.tokens, lengths.image_tokens)

Trainer calls ``set_epoch`` every epoch. On a resume from a checkpoint it skips the consumed micro-batches by
iterating the sampler, but a skipping loader no longer forwards ``set_epoch``: the sampler also registers a
callback that selects the resumed epoch at ``on_train_begin`` (from the restored global step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import BatchRebalanceSampler

from ..core.distributed import BalancedPackingSampler

__all__ = ["BalancedBatchSampler"]


class BalancedBatchSampler(BalancedPackingSampler, BatchRebalanceSampler):
    """A :class:`~vlm_pack.core.distributed.BalancedPackingSampler` that Trainer accepts as its batch sampler.

    Behaviour is ``BalancedPackingSampler``'s (every sample once per epoch when the count divides
    ``num_replicas * micro_batch_size``, ``set_epoch``, ``len``); the ``BatchRebalanceSampler`` base only marks it
    as rank-aware for Trainer and contributes no behaviour.
    """

    @classmethod
    def for_trainer(
        cls,
        trainer: Any,
        token_lengths: Sequence[int] | np.ndarray | torch.Tensor,
        image_token_counts: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        *,
        window_steps: int = 16,
    ) -> "BalancedBatchSampler":
        """The sampler for ``trainer``'s training run: micro-batch ``per_device_train_batch_size``, one replica
        per process, seeded by ``data_seed`` (else ``seed``), ``dataloader_drop_last`` honoured. Call it from
        ``Trainer._get_train_sampler``; it registers the resume callback on ``trainer`` once."""
        args = trainer.args
        sampler = cls(
            token_lengths,
            image_token_counts,
            micro_batch_size=args.per_device_train_batch_size,
            num_replicas=max(1, args.world_size),
            rank=args.process_index,
            seed=args.seed if args.data_seed is None else args.data_seed,
            drop_last=args.dataloader_drop_last,
            window_steps=window_steps,
        )
        handler = trainer.callback_handler
        for stale in [c for c in handler.callbacks if isinstance(c, _ResumeEpoch)]:  # an earlier dataloader's
            handler.remove_callback(stale)
        trainer.add_callback(_ResumeEpoch(sampler))
        return sampler


class _ResumeEpoch(TrainerCallback):
    """Select the epoch a resumed run continues in: Trainer's own count, ``global_step // updates_per_epoch``."""

    def __init__(self, sampler: BalancedBatchSampler) -> None:
        self.sampler = sampler

    def on_train_begin(self, args, state, control, **kwargs):
        accumulation = args.gradient_accumulation_steps
        updates_per_epoch = max(1, -(-self.sampler.num_steps // accumulation))
        self.sampler.set_epoch(state.global_step // updates_per_epoch)
