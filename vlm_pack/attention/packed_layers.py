"""Installing vlm_pack's packed forwards on a model's linear-attention modules (and taking them off again).

``install_linear_attention_packing(model, class_names)`` gives every module of ``model`` whose class is named a
forward of its own: calls that carry ``cu_seq_lens_q`` (a packed row) run vlm_pack's layer
(:mod:`~vlm_pack.attention.gated_deltanet`, :mod:`~vlm_pack.attention.short_conv`, :mod:`~vlm_pack.attention.mamba2`),
chosen by the module's parameter names and checked against its shapes and config when installed, so an unknown
layout fails at ``enable_packing``, not mid-training; every other call (ordinary batches, generation with a cache)
runs the class's own forward untouched. Nothing global changes; ``remove_linear_attention_packing`` restores.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .gated_deltanet import DeltaNetShape, deltanet_forward
from .linear import LINEAR_BACKENDS
from .mamba2 import Mamba2Shape, mamba2_forward
from .short_conv import ShortConvShape, short_conv_forward

__all__ = ["PACKED_LAYERS", "PackedLayer", "install_linear_attention_packing", "remove_linear_attention_packing"]

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


@dataclass(frozen=True)
class PackedLayer:
    """One kind of layer vlm_pack computes itself: ``shape_of(module, config)`` is its dimensions when the module's
    parameters are this kind's (None otherwise); ``forward(module, shape, hidden_states, cu_seqlens, backend)``."""

    name: str
    shape_of: Callable[[torch.nn.Module, Any], Any]
    forward: Callable[..., torch.Tensor]


PACKED_LAYERS: tuple[PackedLayer, ...] = (
    PackedLayer("gated_deltanet", DeltaNetShape.of, deltanet_forward),
    PackedLayer("short_conv", ShortConvShape.of, short_conv_forward),
    PackedLayer("mamba2", Mamba2Shape.of, mamba2_forward),
)
"""The layer kinds, tried in order on each named module."""


def _packed_forward(kind: PackedLayer, shape: Any, backend: str) -> Callable:
    """The forward to bind to one module (a bound method, so ``copy.deepcopy`` rebinds it to the copy)."""

    def forward(self, hidden_states, *args, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            return type(self).forward(self, hidden_states, *args, **kwargs)
        if any(arg is not None for arg in args) or any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
            raise ValueError("packed rows cannot fill a cache: call the model with use_cache=False (a packed row "
                             "reaches the layer with keyword arguments only)")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("a packed row got both cu_seq_lens_q and a padding attention_mask: drop "
                             "attention_mask (packed rows carry their boundaries in cu_seq_lens_*)")
        return kind.forward(self, shape, hidden_states, cu_seqlens, backend)

    forward.__vlm_pack_linear__ = True
    return forward


def _layer_of(module: torch.nn.Module, config: Any) -> tuple[PackedLayer, Any]:
    """The first kind whose parameters ``module`` has, and its checked shape; refuses a module of no known kind."""
    for kind in PACKED_LAYERS:
        shape = kind.shape_of(module, config)
        if shape is not None:
            return kind, shape
    raise NotImplementedError(
        f"{type(module).__name__} has parameters {sorted(n for n, _ in module.named_parameters())}: not a layer "
        f"vlm_pack packs ({', '.join(k.name for k in PACKED_LAYERS)})")


_checked_positions: tuple[weakref.ref, int] | None = None


def _require_boundary_kwargs(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on the layer that holds a packed linear layer: a packed row (position ids restarting inside a
    ``[1, T]`` row) without ``cu_seq_lens_q`` would run the recurrence across samples, so it is refused. One check
    per forward."""
    global _checked_positions
    positions = kwargs.get("position_ids")
    if (kwargs.get("cu_seq_lens_q") is not None or positions is None or positions.shape[0] != 1
            or kwargs.get("attention_mask") is not None
            or any(kwargs.get(name) is not None for name in _CACHE_KWARGS)):
        return  # boundaries given, a padded batch (restarts are padding), or generation with a cache
    if _checked_positions is not None and _checked_positions[0]() is positions \
            and _checked_positions[1] == positions._version:
        return
    row = positions.reshape(-1)
    if bool((row[1:] != row[:-1] + 1).any()):
        raise ValueError(
            "a packed row (position_ids restart inside it) reached a linear-attention layer without "
            "cu_seq_lens_q: pass the boundaries as forward kwargs (**PackedBatch.attention_kwargs(), or "
            "DataCollatorWithFlattening(return_flash_attn_kwargs=True))"
        )
    _checked_positions = (weakref.ref(positions), positions._version)


def remove_linear_attention_packing(model: torch.nn.Module) -> int:
    """Give every module of ``model`` back its class forward (undoes the install); returns how many."""
    restored = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__vlm_pack_linear__", False):
            del module.forward
            module.__dict__.pop("_vlm_pack_position_check").remove()
            restored += 1
    return restored


def install_linear_attention_packing(
    model: torch.nn.Module, class_names: Iterable[str], backend: str = "auto", config: Any = None,
) -> list[torch.nn.Module]:
    """Give every submodule of ``model`` whose class is named in ``class_names`` a packed-row forward.

    ``config``: the config that built those modules (default: ``model.config``'s text config); a Gated DeltaNet
    reads its ``linear_*`` fields, Mamba-2 its ``mamba_*`` ones. ``backend``: ``"auto"`` (fla for CUDA tensors when
    installed, else exact torch), ``"fla"`` or ``"torch_segments"``. Installing again replaces the previous install.
    Returns the modules changed. ``enable_packing`` runs this for the registered recurrent families.
    """
    if backend != "auto" and backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r}; choose 'auto' or one of {LINEAR_BACKENDS}")
    class_names = frozenset(class_names)
    if config is None:
        config = model.config.get_text_config(decoder=True)
    remove_linear_attention_packing(model)
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    modules = [m for m in model.modules() if type(m).__name__ in class_names]
    for module in modules:
        hooked = [name for name, child in module.named_children() if getattr(child, "_hf_hook", None) is not None]
        if hooked:
            raise NotImplementedError(
                f"{type(module).__name__} has accelerate hooks on {hooked} (device_map offloading): packed linear "
                "attention supports models placed on one device; load without offloading"
            )
        kind, shape = _layer_of(module, config)
        module.forward = types.MethodType(_packed_forward(kind, shape, backend), module)
        # The layer around the recurrent module sees the position ids (the module itself does not).
        module._vlm_pack_position_check = parents[module].register_forward_pre_hook(
            _require_boundary_kwargs, with_kwargs=True
        )
    return modules
