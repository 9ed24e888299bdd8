"""Cross entropy on packed rows, exactly equal to the unpacked recipes.

Labels are ALIGNED with the tokens (Hugging Face convention, -100 = ignore); the shift to next-token targets
happens inside each sample (``shift_packed_labels``), so a sample's last slot never predicts the next sample's
first token. Two normalisations:

* ``"token"``: sum over every loss token of the row / number of loss tokens (the usual HF causal-LM loss over a
  padded batch);
* ``"sample"``: mean within each sample, then mean over the samples that have at least one loss token.

All reductions are vectorised (``index_add`` by segment id): no per-sample loop, no host sync.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .packing import IGNORE_INDEX, segment_ids

__all__ = [
    "loss_sum_and_count",
    "packed_cross_entropy",
    "per_sample_loss_sums",
    "sample_mean",
    "shift_packed_labels",
    "token_losses",
]

Reduction = Literal["token", "sample", "none"]


def _flat(labels: torch.Tensor, name: str) -> torch.Tensor:
    """A ``[T]`` view of a ``[T]`` or ``[1, T]`` packed row."""
    if labels.dim() == 2 and labels.shape[0] == 1:
        return labels[0]
    if labels.dim() != 1:
        raise ValueError(f"{name} must be a packed row [1, T] or [T]; got shape {tuple(labels.shape)}")
    return labels


def _check_cu(cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as a flat tensor (a ``[1, N+1]`` row is accepted)."""
    cu = cu_seqlens_padded.reshape(-1)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens_padded needs at least [0, T] (N+1 >= 2 entries); got {cu.tolist()}")
    return cu


def shift_packed_labels(labels: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of a packed row: labels rolled left by one, ``ignore_index`` at each segment's last slot.

    ``labels`` is ``[T]`` or ``[1, T]`` (same shape returned). Tokens past ``cu_seqlens_padded[-1]`` count as
    one more segment, so nothing ever crosses a boundary.
    """
    flat = _flat(labels, "labels")
    cu = _check_cu(cu_seqlens_padded)
    if flat.numel() == 0:
        return labels.clone()
    seg = segment_ids(cu, flat.numel())
    shifted = torch.cat([flat[1:], flat.new_full((1,), ignore_index)])
    crosses = torch.cat([seg[1:] != seg[:-1], seg.new_ones(1, dtype=torch.bool)])
    return shifted.masked_fill(crosses, ignore_index).view_as(labels)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-slot cross entropy in fp32 against already-shifted ``targets`` ([T]; 0 where ignored)."""
    flat_targets = _flat(targets, "targets")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.shape[0] != flat_targets.numel():
        raise ValueError(
            f"logits hold {flat_logits.shape[0]} positions but labels hold {flat_targets.numel()}: pass the logits "
            "of the packed row ([1, T, V] or [T, V]) with its labels ([1, T] or [T])"
        )
    return F.cross_entropy(flat_logits.float(), flat_targets.long(), ignore_index=ignore_index, reduction="none")


def loss_sum_and_count(logits: torch.Tensor, targets: torch.Tensor, *,
                       ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token losses, number of loss tokens)`` against already-shifted ``targets``.

    For distributed reduction: shift on the global row (``shift_packed_labels``), split it across ranks, then
    all-reduce both numbers and divide once, so a rank whose tokens are all ignored adds 0 / 0 and never NaN.
    """
    losses = token_losses(logits, targets, ignore_index)
    count = (_flat(targets, "targets") != ignore_index).sum()
    return losses.sum(), count


def per_sample_loss_sums(logits: torch.Tensor, targets: torch.Tensor, seg: torch.Tensor, num_samples: int, *,
                         ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(loss sums [N], loss-token counts [N])`` given each slot's sample id ``seg`` ([T]).

    Slots whose id is ``>= num_samples`` (fill past the last boundary) are dropped. Sums across ranks can be
    all-reduced before ``sample_mean``.
    """
    losses = token_losses(logits, targets, ignore_index)
    counted = (_flat(targets, "targets") != ignore_index).to(losses.dtype)
    bucket = seg.clamp(max=num_samples)  # extra bucket num_samples collects fill slots
    sums = losses.new_zeros(num_samples + 1).index_add(0, bucket, losses)
    counts = losses.new_zeros(num_samples + 1).index_add(0, bucket, counted)
    return sums[:num_samples], counts[:num_samples]


def sample_mean(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of per-sample means over samples with at least one loss token (0, not NaN, when there are none)."""
    has_tokens = counts > 0
    means = sums / counts.clamp(min=1)
    return (means * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def packed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens_padded: torch.Tensor, *,
                         reduction: Reduction = "token", ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Causal-LM cross entropy of a packed row with labels aligned to tokens (shifted here, per sample).

    Never NaN: no loss token gives 0.

    Args:
        logits: ``[1, T, V]`` or ``[T, V]``.
        labels: ``[1, T]`` or ``[T]``, aligned with the tokens (unshifted; -100 where ignored).
        cu_seqlens_padded: the row's physical sample boundaries (``[N + 1]``, ending at ``T``).
        reduction: ``"token"`` (mean over all loss tokens), ``"sample"`` (mean of per-sample means; samples without
            loss tokens are skipped) or ``"none"`` (per-slot losses shaped like ``labels``, 0 where ignored).
        ignore_index: the label that carries no loss.

    Returns:
        A 0-dim loss (``"token"`` / ``"sample"``) or per-slot losses (``"none"``).
    """
    targets = shift_packed_labels(labels, cu_seqlens_padded, ignore_index)
    if reduction == "token":
        total, count = loss_sum_and_count(logits, targets, ignore_index=ignore_index)
        return total / count.clamp(min=1)
    if reduction == "sample":
        cu = _check_cu(cu_seqlens_padded)
        seg = segment_ids(cu, targets.numel())
        sums, counts = per_sample_loss_sums(logits, targets, seg, cu.numel() - 1, ignore_index=ignore_index)
        return sample_mean(sums, counts)
    if reduction == "none":
        return token_losses(logits, targets, ignore_index).view(labels.shape)
    raise ValueError(f"reduction must be 'token', 'sample' or 'none'; got {reduction!r}")
