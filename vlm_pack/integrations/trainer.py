"""Hugging Face ``Trainer`` / TRL ``SFTTrainer`` glue: exact losses through Trainer's own extension points.

The default recipe needs nothing from this module::

    trainer = Trainer(model=enable_packing(model), data_collator=collator, args=args, train_dataset=examples)

It is exact under gradient accumulation because (1) batches are model-ready with -100 on every sample's first
label (``vlm_pack.core.batch``), so the model's own whole-row shifted loss never crosses a boundary and Trainer's
``num_items_in_batch`` counts exactly the targets, and (2) ``enable_packing`` sets ``accepts_loss_kwargs`` for
families whose loss honours ``num_items_in_batch`` (``ModelRules.loss_honours_num_items``).

Two callables for ``Trainer(compute_loss_func=...)``, Trainer's official custom-loss hook (it receives
``(outputs, labels, num_items_in_batch)``):

With an ``enable_packing`` model both score the head in chunks from the hidden states (``logits`` arrive as
:class:`~vlm_pack.integrations.head_loss.DeferredLogits`), never holding the ``T x V`` logits.

* :func:`compute_loss_func`: the token mean over the accumulation window, for any model (also one whose own loss
  ignores ``num_items_in_batch``);
* :class:`SampleMeanLoss`: mean within each sample, then over the samples of the window. It reads the sample
  boundaries from the forward call (a forward pre-hook) and the window size from Trainer's arguments (it is also
  a ``TrainerCallback``); see its docstring for when it is exact and what it refuses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from ..core.chunked_loss import hidden_weighted_loss, row_targets
from ..core.loss import per_sample_loss_sums
from ..core.packing import IGNORE_INDEX, segment_ids
from .head_loss import DeferredLogits
from .token_mean import check_global_token_count

__all__ = ["SampleMeanLoss", "compute_loss_func"]


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits


def compute_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None,
                      ) -> torch.Tensor:
    """``Trainer(compute_loss_func=vlm_pack.compute_loss_func)``: summed shifted CE / label tokens of the window.

    ``num_items_in_batch`` (Trainer's count of label tokens over the accumulation window) makes the micro-batch
    losses add up to the token mean of the whole window; without it, the micro-batch's own token mean.
    """
    logits = _logits(outputs)
    targets = row_targets(labels)  # a whole-row shift: exact because every sample start is -100
    if isinstance(logits, DeferredLogits):  # an enable_packing model: the head in chunks, never T x V
        total = hidden_weighted_loss(logits.hidden, logits.head, targets, chunk_tokens=logits.chunk_tokens)
    else:
        targets = targets.to(logits.device)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum().clamp(min=1)
    else:
        check_global_token_count(num_items_in_batch, labels)  # once: warns when the count is per rank
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class SampleMeanLoss(TrainerCallback):
    """Per-sample-mean loss for ``Trainer``: pass the SAME object as ``compute_loss_func`` and in ``callbacks``.

    ``loss = SampleMeanLoss(model)``; ``Trainer(model=model, compute_loss_func=loss, callbacks=[loss], ...)``.
    The window loss is ``sum over samples of (mean loss of the sample) / samples in the window``. Trainer calls the
    loss once per micro-batch, without the window's sample count, so each micro-batch contributes
    ``sum of its sample means / (micro_batch_size * gradient_accumulation_steps * processes)``. That is exact when
    every micro-batch holds ``per_device_train_batch_size`` samples with at least one label token and every window
    has ``gradient_accumulation_steps`` micro-batches; anything else raises (a short micro-batch, a sample without
    label tokens, a dataloader length that is not a multiple of the accumulation steps).

    Boundaries come from the forward call itself (a forward pre-hook on ``model`` reads ``cu_seq_lens_q``; an
    ordinary padded batch is one sample per row).
    """

    def __init__(self, model: torch.nn.Module):
        self._cu_seqlens: torch.Tensor | None = None
        self._samples_per_step: int | None = None
        self._per_device: int | None = None
        self._hook = model.register_forward_pre_hook(self._record_boundaries, with_kwargs=True)

    def _record_boundaries(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._cu_seqlens = kwargs.get("cu_seq_lens_q")

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        accumulation = args.gradient_accumulation_steps
        batches = len(train_dataloader) if hasattr(train_dataloader, "__len__") else 0
        if batches % accumulation:
            raise ValueError(
                f"SampleMeanLoss: the dataloader has {batches} micro-batches, not a multiple of "
                f"gradient_accumulation_steps={accumulation}; the last window would be short and its per-sample "
                "mean wrong. Trim the dataset or set dataloader_drop_last=True with a matching size."
            )
        # Trainer multiplies a compute_loss_func loss by the process count when it averages tokens across devices,
        # and DDP averages the gradients: dividing by the process count here leaves the global per-sample mean.
        processes = args.world_size if args.average_tokens_across_devices else 1
        self._per_device = args.per_device_train_batch_size
        self._samples_per_step = self._per_device * accumulation * processes

    def __call__(self, outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        if self._samples_per_step is None:
            raise ValueError(
                "SampleMeanLoss needs Trainer's arguments: pass the same object as callbacks=[loss] too"
            )
        logits = _logits(outputs)
        deferred = isinstance(logits, DeferredLogits)
        device = logits.hidden.device if deferred else logits.device
        targets = row_targets(labels).to(device)
        if self._cu_seqlens is not None and labels.shape[0] == 1:
            cu = self._cu_seqlens.to(device)
        else:  # an ordinary padded batch: each row is one sample
            cu = torch.arange(labels.shape[0] + 1, device=device) * labels.shape[-1]
        num = cu.numel() - 1
        seg = segment_ids(cu, targets.numel())
        if deferred:  # an enable_packing model: the head in chunks, never T x V; weights 1 / tokens of the sample
            counted = (targets.reshape(-1) != IGNORE_INDEX).float()
            counts = counted.new_zeros(num + 1).index_add(0, seg.clamp(max=num), counted)[:num]
            weights = F.pad(1 / counts.clamp(min=1), (0, 1))[seg.clamp(max=num)] * counted
            total = hidden_weighted_loss(logits.hidden, logits.head, targets, weights,
                                         chunk_tokens=logits.chunk_tokens)
        else:
            sums, counts = per_sample_loss_sums(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), seg, num)
            total = (sums / counts.clamp(min=1)).sum()  # samples without label tokens (e.g. a fill segment) add 0
        with_labels = int((counts > 0).sum())  # one host sync per micro-batch
        if with_labels != self._per_device:
            raise ValueError(
                f"SampleMeanLoss: a micro-batch holds {with_labels} samples with label tokens, expected "
                f"per_device_train_batch_size={self._per_device}; the per-sample mean over the window is then not "
                "exact. Drop samples without labels and use dataloader_drop_last=True."
            )
        return total / self._samples_per_step
