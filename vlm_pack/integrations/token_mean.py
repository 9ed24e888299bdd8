"""One check that Trainer's token mean is global across data-parallel ranks.

Trainer passes ``num_items_in_batch`` (label tokens of the gradient-accumulation window) to the model's loss or
to ``compute_loss_func``. With ``average_tokens_across_devices=True`` (the default) it is the count summed over
all ranks, the same on every rank, and the gradients that DDP / FSDP / DeepSpeed average are those of the global
token mean. With ``False`` each rank divides by its own count: the result is the mean of per-rank token means,
which weighs a rank's tokens by the inverse of its count (1.6e-1 relative gradient error measured on a tiny
Qwen2-VL at 2 ranks). Nothing in the batch can show it, so the first training
forward in a world of several processes compares the count across ranks (two scalar all-reduces, once per
process) and warns when it is not the global one.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..core.packing import IGNORE_INDEX

__all__ = ["check_global_token_count", "install_token_mean_check"]

logger = logging.getLogger(__name__)
_checked = False


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_global_token_count(num_items_in_batch: torch.Tensor | int, labels: torch.Tensor) -> bool:
    """Once per process in a world > 1: True (and a warning naming the flag) when ``num_items_in_batch`` is not
    the global window count: it differs between ranks, or is below the label tokens of this micro-batch on all
    ranks together. Every rank must call it at the same step (it all-reduces); later calls return False."""
    global _checked
    if _checked or _world_size() == 1:
        return False
    _checked = True
    count = float(num_items_in_batch)
    local = float(labels[..., 1:].ne(IGNORE_INDEX).sum())
    extremes = torch.tensor([count, -count], dtype=torch.float64, device=labels.device)
    total = torch.tensor([local], dtype=torch.float64, device=labels.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    highest, lowest = float(extremes[0]), -float(extremes[1])
    if highest == lowest and lowest >= float(total[0]):
        return False
    logger.warning(
        "vlm_pack: the loss denominator num_items_in_batch is per rank (%g to %g label tokens on %d ranks), not "
        "the global count: with TrainingArguments(average_tokens_across_devices=False) every rank takes its own "
        "token mean and the ranks are then averaged, so gradients are not the global token mean. Set "
        "average_tokens_across_devices=True (the default).",
        lowest, highest, _world_size(),
    )
    return True


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    count, labels = kwargs.get("num_items_in_batch"), kwargs.get("labels")
    if count is None or labels is None or _world_size() == 1:
        return None
    module._vlm_pack_token_mean_hook.remove()
    check_global_token_count(count, labels)
    return None


def install_token_mean_check(model: torch.nn.Module) -> None:
    """Forward pre-hook on ``model``: the check at its first forward that carries ``num_items_in_batch`` in a
    multi-process world, then the hook removes itself (no cost per step)."""
    if getattr(model, "_vlm_pack_token_mean_hook", None) is None:
        model._vlm_pack_token_mean_hook = model.register_forward_pre_hook(_hook, with_kwargs=True)
