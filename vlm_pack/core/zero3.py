"""DeepSpeed ZeRO-3 and a loss that reads the LM head's weight directly (the chunked loss's fused path).

ZeRO-3 keeps each parameter partitioned (``ds_id``; its ``.data`` empty) except while a module that owns it runs. A
loss that multiplies hidden states by ``lm_head.weight`` itself needs the whole weight once per call, and its
gradient must reach ``.grad`` while the weight is whole again (autograd checks the gradient against the parameter's
shape; ZeRO-3's gradient hook then reduce-scatters it into the partition). DeepSpeed does both when the weight is
read inside its engine's forward: the read gathers it (one all-gather) and registers it as an external parameter of
the module running, which gathers it again before that module's backward (DeepSpeed's automatic external-parameter
discovery; TRL's fused losses rely on the same, through ``maybe_gather_lm_head_ctx`` and a loss run inside the
forward). Read anywhere else, the weight stays partitioned, and its gradient would arrive with nowhere to go:
:func:`require_gathered` refuses that, naming the fix. A weight that takes no gradient is simply gathered for the
block (:func:`zero3_gathered`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

__all__ = ["partitioned", "require_gathered", "zero3_gathered"]


def partitioned(tensor: Any) -> bool:
    """Whether ``tensor`` is a parameter DeepSpeed ZeRO-3 manages and has not gathered now."""
    if not hasattr(tensor, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # importable whenever a ds_id exists

    return tensor.ds_status != ZeroParamStatus.AVAILABLE


def zero3_gathered(*params: torch.Tensor | None):
    """Context: the partitioned ``params`` gathered for the block in one collective and partitioned again on exit
    (``deepspeed.zero.GatheredParameters``, ``modifier_rank=None``: read, not modified); a null context when none is
    partitioned. Every rank must enter it the same number of times (the losses here: once per call, on every rank).
    For weights that take no gradient in the block (see the module docstring)."""
    missing = list({id(p): p for p in params if p is not None and partitioned(p)}.values())
    if not missing:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(missing, modifier_rank=None)


def require_gathered(module: torch.nn.Module, params: dict[str, torch.Tensor | None]) -> None:
    """Raise when a parameter that will take a gradient is still partitioned: the loss runs outside the model's
    forward under ZeRO-3 (``Trainer(compute_loss_func=...)`` scores the deferred logits after the forward)."""
    stale = [name for name, p in params.items() if p is not None and p.requires_grad and partitioned(p)]
    if stale and torch.is_grad_enabled():
        raise ValueError(
            f"the LM head's {', '.join(stale)} ({type(module).__name__}) is partitioned by DeepSpeed ZeRO-3 and this "
            "loss runs outside the model's forward, where ZeRO-3 cannot gather it for the backward. Under ZeRO-3 "
            "let the forward compute the loss (the default Trainer recipe: labels in the batch, no "
            "compute_loss_func; UlyssesTrainer does), or pass enable_packing(model, chunked_loss=False) to score full "
            "logits with compute_loss_func / SampleMeanLoss"
        )
