"""Mixture-of-experts router load-balancing loss on packed rows: exactly the padded micro-batch's.

transformers' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6: ``num_experts * sum_e f_e * P_e``, with
``f_e`` the share of top-k assignments that go to expert ``e`` and ``P_e`` its mean router probability) averages over
the tokens its ``attention_mask`` marks: a padded micro-batch's aux loss is a mean over the REAL tokens of the whole
micro-batch (never a per-sample quantity). The router scores each token from that token's hidden state, which
packing leaves exact, so a packed row holding the same samples gives the same value as long as the mean covers
the same tokens: its real slots, not its alignment slots (context-parallel / sequence-parallel multiples) nor a
``pad_to_length`` fill, which a forward without ``attention_mask`` would count.

Rule: the family's LM-head forward (``...ForCausalLM`` / ``...ForConditionalGeneration``) hands its
``attention_mask`` argument both to ``load_balancing_loss_func`` and to its inner model. On a packed row (a call
carrying ``cu_seq_lens_q``) that computes the aux loss, a forward pre-hook passes the row's real-slot mask as that
``attention_mask``, and a pre-hook on every inner model takes it away again, so attention still runs on the packed
boundaries alone. The mask comes from the batch's bookkeeping (``batch["vlm_pack"]``, which ``model(**batch)``
passes along, as Trainer and TRL call it); a packed row without it is refused, since its alignment slots cannot be
told from real tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import transformers

from ..core.batch import METADATA_KEY
from ..core.packed_seq_params import packed_boundaries
from ..core.packing import segment_ids
from ..models import text_config

__all__ = ["install_router_loss_mask", "real_slot_mask", "router_loss_on"]

_MARK = "_vlm_pack_router_slots"  # set on the mask tensor this module builds; inner models drop such a mask


def router_loss_on(config: Any, kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether the forward computes the router aux loss: its ``output_router_logits`` kwarg, else the config's."""
    flag = None if kwargs is None else kwargs.get("output_router_logits")
    if flag is None:
        flag = getattr(text_config(config), "output_router_logits", False) or getattr(config, "output_router_logits",
                                                                                       False)
    return bool(flag)


def real_slot_mask(metadata: Mapping[str, Any] | None, width: int, device: torch.device | None = None) -> torch.Tensor:
    """``[1, width]`` int64 mask of a packed row: 1 on real tokens, 0 on alignment slots and on a trailing fill.

    ``metadata``: the batch's ``batch["vlm_pack"]``, holding physical and real boundaries (``VLMPackingCollator``:
    ``cu_seqlens_padded`` / ``cu_seqlens``; ``PackedSFTDataset``: ``cu_seqlens`` / ``cu_seqlens_unpadded``). A slot
    is real when it lies within the real length of its physical segment. Vectorised; two host syncs.
    """
    if not isinstance(metadata, Mapping) or not metadata:
        raise ValueError(
            "output_router_logits=True on a packed row without its bookkeeping (batch['vlm_pack']): the router "
            "load-balancing loss must exclude the row's alignment slots, which only that entry locates. Call "
            "model(**batch) with the collator's whole batch (model_inputs(batch) drops the entry), or set "
            "output_router_logits=False"
        )
    if metadata.get("cu_seqlens_padded") is None and metadata.get("cu_seqlens_unpadded") is None:
        raise ValueError(
            "output_router_logits=True on an offline pack without real boundaries (batch['vlm_pack'] has no "
            "cu_seqlens_unpadded): a pad_to_max_length fill cannot be told from a sample, so the router "
            "load-balancing loss could count it. Build PackedSFTDataset with pad_seq_to_mult >= 2 (it then records "
            "them) or set output_router_logits=False"
        )
    physical, real = packed_boundaries(metadata)
    physical = physical.to(device=device, dtype=torch.long)
    total = int(physical[-1])
    if total != width:
        raise ValueError(
            f"output_router_logits=True on a row of {width} slots whose boundaries span {total}: a context-parallel "
            "shard (or a row cut elsewhere) holds part of the micro-batch, and the load-balancing loss is a "
            "statistic of the whole micro-batch; compute it once from the gathered router logits of every rank"
        )
    if real is None:
        return torch.ones(1, width, dtype=torch.long, device=physical.device)
    real = real.to(device=physical.device, dtype=torch.long)
    if real.numel() != physical.numel():
        raise ValueError(f"batch['vlm_pack'] holds {physical.numel() - 1} physical but {real.numel() - 1} real "
                         "segments: the packed row's bookkeeping is inconsistent")
    segment = segment_ids(physical, width)
    offset = torch.arange(width, device=physical.device) - physical[segment]
    return (offset < real.diff()[segment]).long().unsqueeze(0)


def _width(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if ids is not None else kwargs.get("inputs_embeds")


def _inject(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Pre-hook of the module that computes the aux loss: a packed row's real-slot mask as its ``attention_mask``."""
    if kwargs.get("cu_seq_lens_q") is None or not router_loss_on(module.config, kwargs):
        return None
    if kwargs.get("attention_mask") is not None or len(args) > 1:
        raise ValueError(
            "output_router_logits=True on a packed row given an attention_mask (or positional arguments): the "
            "router load-balancing loss would read that mask instead of the row's real slots. Call model(**batch) "
            "with the packed batch as it is (no attention_mask)"
        )
    reference = _width(args, kwargs)
    mask = real_slot_mask(kwargs.get(METADATA_KEY), reference.shape[1], reference.device)
    setattr(mask, _MARK, True)
    return args, {**kwargs, "attention_mask": mask}


def _drop(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Pre-hook of the inner models: the real-slot mask is for the aux loss only, never for attention."""
    if getattr(kwargs.get("attention_mask"), _MARK, False):
        return args, {**kwargs, "attention_mask": None}
    return None


def _computes_aux_loss(module: torch.nn.Module) -> bool:
    if not isinstance(module, transformers.PreTrainedModel):
        return False
    parameters = inspect.signature(module.forward).parameters
    return "labels" in parameters and "output_router_logits" in parameters


def install_router_loss_mask(model: torch.nn.Module) -> bool:
    """Hook the outermost module of ``model`` whose forward adds the aux loss (``labels`` and
    ``output_router_logits`` in its signature) and every model inside it (once; ``enable_packing`` may be called
    again). False when ``model`` holds no such module (a bare backbone returns router logits only: a caller
    computing the loss from them masks them with :func:`real_slot_mask`)."""
    owner = next((module for module in model.modules() if _computes_aux_loss(module)), None)
    if owner is None:
        return False
    if getattr(owner, "_vlm_pack_router_hook", None) is None:
        owner._vlm_pack_router_hook = owner.register_forward_pre_hook(_inject, with_kwargs=True)
        for module in owner.modules():
            if module is not owner and isinstance(module, transformers.PreTrainedModel):
                module._vlm_pack_router_drop = module.register_forward_pre_hook(_drop, with_kwargs=True)
    return True
