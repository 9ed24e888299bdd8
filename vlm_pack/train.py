"""One training step on a collated batch, packed or padded, with the same loss definition for both.

Used by the demo, the examples and the benchmarks so that "packed vs padded" compares the layout only:
a packed row (``cu_seq_lens_q`` present) goes through the varlen attention path with the loss shifted inside
each sample; a padded batch goes through the model with its ``attention_mask`` and the loss shifted per row.
Both normalise the same way (``"token"``: mean over all loss tokens of the micro-batch, or ``"sample"``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .collator import model_inputs
from .loss import Reduction, packed_cross_entropy, sample_mean, token_losses

__all__ = ["StepResult", "batch_loss", "is_packed", "train_step"]


def is_packed(batch: Mapping[str, Any]) -> bool:
    """A packed batch carries its boundaries; a padded one carries an attention mask instead."""
    return "cu_seq_lens_q" in batch


def _padded_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    losses = token_losses(logits, targets.reshape(-1)).view_as(targets)
    counts = (targets != -100).sum(dim=1)
    if reduction == "token":
        return losses.sum() / counts.sum().clamp(min=1)
    if reduction == "sample":
        return sample_mean(losses.sum(dim=1), counts.to(losses.dtype))
    raise ValueError(f"reduction must be 'token' or 'sample'; got {reduction!r}")


def batch_loss(model: torch.nn.Module, batch: Mapping[str, Any], reduction: Reduction = "token") -> torch.Tensor:
    """Forward ``batch`` through ``model`` and return the causal-LM loss (packed or padded alike)."""
    logits = model(**model_inputs(batch), use_cache=False).logits
    if is_packed(batch):
        return packed_cross_entropy(logits, batch["labels"], batch["cu_seqlens_padded"], reduction=reduction)
    return _padded_loss(logits, batch["labels"], reduction)


@dataclass(frozen=True)
class StepResult:
    loss: float
    real_tokens: int
    padded_slots: int
    seconds: float


def train_step(model: torch.nn.Module, batch: Mapping[str, Any], optimizer: torch.optim.Optimizer,
               reduction: Reduction = "token") -> StepResult:
    """Forward, backward and optimizer step; returns the loss and the batch's token counts and wall time."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, reduction)
    loss.backward()
    optimizer.step()
    value = float(loss.detach())
    stats = batch["stats"]
    return StepResult(value, stats.real_tokens, stats.padded_slots, time.perf_counter() - start)
