"""One training step on a collated batch, packed or padded, with the same loss definition for every layout.

Used by the demo, the examples and the benchmarks so that "packed vs padded" compares the layout only:

* in-batch packed row (``VLMPackingCollator``, ``cu_seq_lens_q`` present): varlen attention, loss shifted
  inside each sample;
* offline pack (``PackedSFTDataset`` / ``PackedDataset``: the same Hugging Face names): the same;
* padded batch (``attention_mask`` present): the model masks padding, loss shifted per row.

All normalise the same way (``"token"``: mean over the micro-batch's loss tokens, or ``"sample"``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..core.batch import model_inputs
from ..core.loss import Reduction, packed_cross_entropy

__all__ = ["StepResult", "batch_loss", "train", "train_step"]

def _padded_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """A ``[B, S]`` batch is a packed row whose segments are its rows: the same loss code serves both."""
    rows, width = labels.shape
    boundaries = torch.arange(rows + 1, device=labels.device) * width
    return packed_cross_entropy(logits.reshape(rows * width, -1), labels.reshape(-1), boundaries, reduction=reduction)


def batch_loss(model: torch.nn.Module, batch: Mapping[str, Any], reduction: Reduction = "token") -> torch.Tensor:
    """Forward ``batch`` through ``model`` and return the causal-LM loss, whatever the batch layout."""
    logits = model(**model_inputs(batch), use_cache=False).logits
    if "cu_seq_lens_q" in batch:
        return packed_cross_entropy(logits, batch["labels"], batch["cu_seq_lens_q"], reduction=reduction)
    return _padded_loss(logits, batch["labels"], reduction)


@dataclass(frozen=True)
class StepResult:
    loss: float
    seconds: float


def train_step(model: torch.nn.Module, batch: Mapping[str, Any], optimizer: torch.optim.Optimizer,
               reduction: Reduction = "token") -> StepResult:
    """Forward, backward and optimizer step; returns the loss and the step's wall time."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, reduction)
    loss.backward()
    optimizer.step()
    return StepResult(float(loss.detach()), time.perf_counter() - start)


def train(model: torch.nn.Module, batches: Iterable[Mapping[str, Any]], optimizer: torch.optim.Optimizer,
          steps: int, *, reduction: Reduction = "token", desc: str = "train") -> list[float]:
    """Run ``steps`` train steps, cycling over ``batches`` (a DataLoader) as often as needed; returns the losses."""
    model.train()
    losses: list[float] = []
    with tqdm(total=steps, desc=desc, unit="step") as progress:
        while len(losses) < steps:
            for batch in batches:
                losses.append(train_step(model, batch, optimizer, reduction).loss)
                progress.update()
                progress.set_postfix(loss=f"{losses[-1]:.4f}")
                if len(losses) == steps:
                    break
    return losses
