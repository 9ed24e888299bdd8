"""Evaluation of packed batches with ``Trainer`` / TRL: the token-mean eval loss and per-sample predictions.

Trainer's evaluation loop sees one row per packed micro-batch. Left alone, ``predict()`` returns
``[micro-batches, T, V]`` logits with no sample boundaries (decoding or scoring a row mixes samples), and
``eval_loss`` is the mean of the micro-batch token means (each batch weighs the same however many tokens it holds),
not the token mean over the evaluation set. :class:`PackedEvaluation` plugs into Trainer's own metric hooks::

    evaluation = PackedEvaluation(model)
    Trainer(..., preprocess_logits_for_metrics=evaluation.preprocess_logits_for_metrics,
            compute_metrics=evaluation.compute_metrics)

With an ``enable_packing`` model the forward itself scores every slot in chunks (argmax id and the next label's
cross entropy, ``[B, T, 2]``: :func:`~vlm_pack.integrations.head_loss.slot_scores`), so evaluation never holds
``T x V`` logits either. Per micro-batch, ``preprocess_logits_for_metrics`` turns the logits into three small per-slot arrays (what
``predict()`` then returns as ``predictions``): the predicted token of every slot, the cross entropy of its label,
and the slot's sample index (from the ``cu_seq_lens_q`` of that forward, read by a forward pre-hook; -1 off any
sample). :func:`split_predictions` cuts them, with the labels, into one :class:`SamplePrediction` per sample.
``compute_metrics`` returns ``loss`` (the token mean over the whole evaluation, which Trainer reports as
``eval_loss`` in place of its mean of batch means), ``token_accuracy`` and whatever ``metrics(samples)`` adds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..core.batch import METADATA_KEY
from ..core.packing import IGNORE_INDEX, segment_ids
from .head_loss import score_slots_in_evaluation

__all__ = ["PackedEvaluation", "SamplePrediction", "split_predictions"]


@dataclass(frozen=True)
class SamplePrediction:
    """One sample's slots, in token order, aligned with its labels (no shift left to do).

    ``labels``: the sample's labels (-100 where not a target). ``predictions``: the token the model predicted for
    each slot (argmax of the previous slot's logits; -100 at the sample's first slot). ``token_losses``: the cross
    entropy of each target (0 where ``labels`` is -100).
    """

    labels: np.ndarray
    predictions: np.ndarray
    token_losses: np.ndarray

    @property
    def targets(self) -> np.ndarray:
        """Boolean mask of the slots that are targets."""
        return self.labels != IGNORE_INDEX


class PackedEvaluation:
    """Trainer's ``preprocess_logits_for_metrics`` / ``compute_metrics`` for packed (and ordinary padded) batches.

    ``model``: the model given to Trainer (a forward pre-hook reads each batch's sample boundaries). ``metrics``:
    optional ``samples -> dict`` of extra metrics over the :class:`SamplePrediction` list of the evaluation.
    ``batch_eval_metrics=True`` is not supported (the token mean needs the whole evaluation).
    """

    def __init__(self, model: torch.nn.Module,
                 metrics: Callable[[list[SamplePrediction]], Mapping[str, float]] | None = None):
        self.metrics = metrics
        self._rows: dict[str, Any] = {}
        self._scores = score_slots_in_evaluation(model)  # an enable_packing model scores slots in chunks
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        meta = kwargs.get(METADATA_KEY) or {}
        self._rows = {"cu": kwargs.get("cu_seq_lens_q"), "lengths": meta.get("seq_lengths"),
                      "mask": kwargs.get("attention_mask"),
                      "scored": self._scores and not module.training}

    def _sample_ids(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """``[B, T]`` sample index of every slot of the last forward's batch (-1: alignment, fill, padding)."""
        rows, width = shape
        cu, lengths, mask = self._rows.get("cu"), self._rows.get("lengths"), self._rows.get("mask")
        if cu is None:  # an ordinary batch: one sample per row, its padding (if a mask says so) off
            ids = torch.zeros(rows, width, dtype=torch.long, device=device)
            if mask is not None and mask.shape == shape:
                ids = ids.masked_fill(mask.to(device) == 0, -1)
            return ids
        if rows != 1:
            raise ValueError(f"PackedEvaluation: a packed forward (cu_seq_lens_q) with {rows} rows; packed rows are [1, T]")
        cu = cu.to(device).reshape(-1).long()
        seg = segment_ids(cu, width)  # slots past the last boundary (padding added across processes) get N
        count = cu.numel() - 1 if lengths is None else lengths.numel()
        real = seg < count
        if lengths is not None:  # the collator's real lengths: alignment and fill slots belong to no sample
            offset = torch.arange(width, device=device) - cu[seg.clamp(max=cu.numel() - 2)]
            real &= offset < lengths.to(device).long()[seg.clamp(max=count - 1)]
        return torch.where(real, seg, torch.full_like(seg, -1)).unsqueeze(0)

    def preprocess_logits_for_metrics(self, logits: Any, labels: torch.Tensor,
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(predicted ids, token losses, sample ids)``, each ``[B, T]`` and aligned with ``labels``."""
        if isinstance(logits, (tuple, list)):  # other model outputs (e.g. rope_deltas) ride along
            logits = logits[0]
        ids = self._sample_ids(labels.shape, labels.device)
        # Slot t's prediction comes from slot t-1 of the same sample; a sample's first slot has none.
        start = torch.ones_like(ids, dtype=torch.bool)
        start[:, 1:] = ids[:, 1:] != ids[:, :-1]
        targets = labels.masked_fill(start | (ids < 0), IGNORE_INDEX)
        if self._rows.get("scored") and logits.dim() == 3 and logits.shape[-1] == 2:  # [B, T, 2] slot scores of the chunked head: argmax id, next label's loss
            previous = logits[:, :-1]
            argmax = previous[..., 0].long()
            losses = previous[..., 1].masked_fill(targets[:, 1:] == IGNORE_INDEX, 0.0)
        else:
            previous = logits[:, :-1].float()
            argmax = previous.argmax(-1)
            losses = F.cross_entropy(previous.transpose(1, 2), targets[:, 1:], ignore_index=IGNORE_INDEX,
                                     reduction="none")
        predicted = F.pad(argmax, (1, 0), value=IGNORE_INDEX).masked_fill(start, IGNORE_INDEX)
        return predicted, F.pad(losses, (1, 0)), ids

    def compute_metrics(self, eval_pred: Any) -> dict[str, float]:
        """``loss`` (token mean over every target of the evaluation), ``token_accuracy``, then ``metrics(samples)``."""
        samples = split_predictions(eval_pred)
        count = sum(int(s.targets.sum()) for s in samples)
        total = sum(float(s.token_losses[s.targets].sum(dtype=np.float64)) for s in samples)
        correct = sum(int((s.predictions == s.labels)[s.targets].sum()) for s in samples)
        result = {"loss": total / max(count, 1), "token_accuracy": correct / max(count, 1)}
        if self.metrics is not None:
            result.update(self.metrics(samples))
        return result

    def remove(self) -> None:
        """Detach the forward pre-hook from the model."""
        self._hook.remove()


def split_predictions(output: Any) -> list[SamplePrediction]:
    """One :class:`SamplePrediction` per sample, in evaluation order, from ``trainer.predict(...)`` (or the
    ``EvalPrediction`` given to ``compute_metrics``) of a Trainer using :class:`PackedEvaluation`."""
    predictions = output.predictions
    if not (isinstance(predictions, (tuple, list)) and len(predictions) == 3):
        raise ValueError(
            "split_predictions needs the (predicted ids, token losses, sample ids) triple that "
            "PackedEvaluation.preprocess_logits_for_metrics returns: pass "
            "preprocess_logits_for_metrics=evaluation.preprocess_logits_for_metrics to Trainer"
        )
    predicted, losses, ids = (np.asarray(a) for a in predictions)
    labels = np.asarray(output.label_ids)
    samples = []
    for row in range(ids.shape[0]):
        row_ids = ids[row]
        cuts = np.flatnonzero(np.diff(row_ids)) + 1
        for piece in np.split(np.arange(row_ids.size), cuts):
            if row_ids[piece[0]] >= 0:
                samples.append(SamplePrediction(labels[row, piece], predicted[row, piece].astype(np.int64),
                                                losses[row, piece]))
    return samples
