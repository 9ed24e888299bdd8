"""Packed rows through Gated DeltaNet (linear-attention) layers: conv window and recurrent state restart per sample.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) interleave full attention with Gated DeltaNet layers. A DeltaNet
layer carries context along the row in two places: a short causal depthwise conv over the last ``K - 1`` tokens,
and the recurrent state of the gated delta rule. In a packed row both must start from zero at every boundary,
or sample i+1 reads sample i. Boundaries come from the forward kwarg ``cu_seq_lens_q``
(``PackedBatch.attention_kwargs()``), which transformers forwards to these layers.

Backends (``LINEAR_BACKENDS``), chosen per call like the attention backends:

* ``"fla"``: flash-linear-attention's varlen kernels, ``chunk_gated_delta_rule(..., cu_seqlens=)`` and
  ``fla.modules.convolution.causal_conv1d(..., cu_seqlens=)``: CUDA, optional, imported at run time;
* ``"torch_segments"``: exact everywhere, by running transformers' own torch reference functions on a layout in
  which every sample starts fresh: the conv over a row with ``K - 1`` zeros in front of each sample, the delta
  rule over a batch of samples grouped by their number of 64-token chunks (the reference pads each sample to
  whole chunks anyway, so grouping adds no work). One host sync per forward, shared by all layers.

How it plugs in, and why this way: transformers resolves these functions once, at import of the modeling file
(``use_kernel_func_from_hub_with_fallback``: hub kernel > original package > torch), into module globals that
the layer's ``forward`` calls by name. Without the ``kernels`` package the kernel decorators are no-ops, and
even with it no registered mapping reaches a function called through a module global. So
``install_linear_attention_packing(model)`` gives each DeltaNet module of THAT model its own ``forward``:
transformers' own forward code, bound to a private copy of its modeling namespace in which ``causal_conv1d_fn``
and ``torch_chunk_gated_delta_rule`` read the boundaries. Nothing global changes; calls without boundaries take
the original functions; ``remove_linear_attention_packing(model)`` restores the modules.

Note: stock transformers with flash-linear-attention installed passes ``cu_seqlens`` to the delta rule but not
to the conv (``causal_conv1d_fn`` gets no ``seq_idx``), so the conv window leaks across samples there; both go
through the boundaries here.

Context parallelism is refused: a rank holding zigzag chunks would need the recurrent and conv state of the
chunks before it (a state hand-off between ranks, not implemented).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "CONTEXT_PARALLEL_REFUSAL",
    "LINEAR_BACKENDS",
    "SegmentLayout",
    "install_linear_attention_packing",
    "remove_linear_attention_packing",
    "segmented_causal_conv1d",
    "segmented_gated_delta_rule",
    "select_linear_backend",
]

LINEAR_BACKENDS: tuple[str, ...] = ("fla", "torch_segments")
"""Backend names ``install_linear_attention_packing`` accepts (besides ``"auto"``)."""

CONV_FUNCTION = "causal_conv1d_fn"
RULE_FUNCTION = "torch_chunk_gated_delta_rule"
_CHUNK = 64  # chunk size of transformers' torch_chunk_gated_delta_rule (passed explicitly)
_FLA_ACTIVATIONS = (None, "silu", "swish")
CONTEXT_PARALLEL_REFUSAL = (
    "linear-attention (Gated DeltaNet) layers cannot run on a context-parallel shard: each rank would need the "
    "recurrent and conv state of the chunks before it (state hand-off between ranks is not implemented); train "
    "this model with context_parallel_size=1"
)


FLA_MIN_VERSION = (0, 5, 0)
"""flash-linear-attention <= 0.4.2 mis-computes the gated delta rule when key heads < value heads (grouped values
arrived in 0.5.0), and 0.2.x's causal_conv1d returns a bare tensor."""


def _fla_version_error() -> str | None:
    """Why the installed flash-linear-attention is too old, or None (also None when no distribution is found)."""
    from importlib import metadata

    try:
        version = metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        return None
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    if parts < FLA_MIN_VERSION:
        return (f"flash-linear-attention {version} is older than 0.5.0 (wrong gated delta rule with fewer key than "
                "value heads): pip install 'flash-linear-attention>=0.5.0'")
    return None


@lru_cache(maxsize=None)
def fla_error() -> str | None:
    """None when flash-linear-attention's two varlen kernels import for real (checked once) at a version >= 0.5.0,
    else why not. Only the CUDA route asks (importing fla costs seconds)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install 'vlm_pack[fla]')"
    too_old = _fla_version_error()
    if too_old is not None:
        return too_old
    try:
        for module, name in _FLA_FUNCTIONS:
            getattr(importlib.import_module(module), name)
    except Exception as error:  # a broken install: undefined symbol, missing function
        return f"import {module}.{name} failed: {type(error).__name__}: {error}"
    return None


def fla_installed() -> bool:
    """True when flash-linear-attention's varlen kernels can run (imported for real, version >= 0.5.0)."""
    return fla_error() is None


def select_linear_backend(device: torch.device | str) -> str:
    """The backend ``"auto"`` resolves to: ``"fla"`` for CUDA tensors when usable, else ``"torch_segments"``."""
    return "fla" if torch.device(device).type == "cuda" and fla_installed() else "torch_segments"


_FLA_FUNCTIONS = (("fla.modules.convolution", "causal_conv1d"), ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"))


def _fla_function(module: str, name: str) -> Callable:
    too_old = _fla_version_error()
    if too_old is not None:
        raise ImportError(f"linear backend 'fla': {too_old}; or choose linear_backend='torch_segments'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"linear backend 'fla' needs {module}.{name} from flash-linear-attention (pip install "
            "'vlm_pack[fla]' on a CUDA machine), or choose linear_backend='torch_segments'"
        ) from error


# ------------------------------------------------------------------ the packed-row layout (host plan)


@dataclass(frozen=True)
class SegmentLayout:
    """Where each token of a packed row goes on the exact torch path; built on the host from ``cu_seqlens``.

    ``buckets``: per group of samples with the same number of 64-token chunks, a gather index ``[n, C * 64]``
    into the row plus one zero slot (index ``total``) that fills each sample up to whole chunks.
    ``unbucket``: for each token, its place in the concatenated, flattened bucket outputs.
    """

    lengths: tuple[int, ...]
    total: int
    buckets: tuple[torch.Tensor, ...]
    unbucket: torch.Tensor
    _conv: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total: int) -> "SegmentLayout":
        """Plan for a row of ``total`` slots; ``cu_seqlens`` must cover it exactly (else: context parallel)."""
        cu = cu_seqlens.reshape(-1).to("cpu", torch.int64).numpy()  # the one host sync
        if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seq_lens_q={cu.tolist()} must start at 0 and never decrease")
        if cu[-1] != total:
            raise ValueError(f"cu_seq_lens_q ends at {int(cu[-1])} but the packed row has {total} tokens: "
                             + (CONTEXT_PARALLEL_REFUSAL if cu[-1] > total else "pass the boundaries of this row"))
        lengths = np.diff(cu)
        starts = cu[:-1]
        chunks = -(-lengths // _CHUNK)
        device = cu_seqlens.device
        buckets, unbucket, offset = [], np.empty(total, dtype=np.int64), 0
        for count in np.unique(chunks[lengths > 0]):
            members = np.flatnonzero((chunks == count) & (lengths > 0))
            width = int(count) * _CHUNK
            steps = np.arange(width)
            index = np.where(steps < lengths[members, None], starts[members, None] + steps, total)
            buckets.append(torch.from_numpy(index).to(device))
            for row, sample in enumerate(members):
                span = slice(starts[sample], starts[sample] + lengths[sample])
                unbucket[span] = offset + row * width + np.arange(lengths[sample])
            offset += len(members) * width
        return cls(tuple(int(n) for n in lengths), total, tuple(buckets), torch.from_numpy(unbucket).to(device))

    def conv_positions(self, kernel_size: int) -> tuple[torch.Tensor, int]:
        """Slot of each token in a row that has ``kernel_size - 1`` zeros before every sample, and its width."""
        if kernel_size not in self._conv:
            lengths = np.asarray(self.lengths, dtype=np.int64)
            gap = kernel_size - 1
            shift = np.repeat(gap * np.arange(1, len(lengths) + 1), lengths)
            positions = torch.from_numpy(np.arange(self.total) + shift).to(self.unbucket.device)
            self._conv[kernel_size] = (positions, self.total + gap * len(lengths))
        return self._conv[kernel_size]


# Every layer of one forward receives the same cu_seq_lens_q tensor: plan once per forward.
_layout_cache: tuple[weakref.ref, int, int, SegmentLayout] | None = None


def packed_layout(cu_seqlens: torch.Tensor, total: int) -> SegmentLayout:
    """``SegmentLayout.from_cu_seqlens``, cached for the last boundaries tensor seen (one sync per forward)."""
    global _layout_cache
    if _layout_cache is not None:
        ref, version, cached_total, layout = _layout_cache
        if ref() is cu_seqlens and version == cu_seqlens._version and cached_total == total:
            return layout
    layout = SegmentLayout.from_cu_seqlens(cu_seqlens, total)
    _layout_cache = (weakref.ref(cu_seqlens), cu_seqlens._version, total, layout)
    return layout


# ------------------------------------------------------------------ exact torch path (transformers' own math)


def segmented_causal_conv1d(
    reference: Callable, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    activation: str | None, layout: SegmentLayout,
) -> torch.Tensor:
    """Causal depthwise conv ``[1, C, T]`` restarted per sample: ``reference`` (transformers' torch conv, which
    zero-pads ``K - 1`` slots on the left) runs over a row with ``K - 1`` zeros before every sample."""
    positions, width = layout.conv_positions(weight.shape[-1])
    spaced = hidden_states.new_zeros(*hidden_states.shape[:2], width).index_copy(2, positions, hidden_states)
    return reference(spaced, weight, bias, activation=activation).index_select(2, positions)


def segmented_gated_delta_rule(
    reference: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, layout: SegmentLayout, use_qk_l2norm_in_kernel: bool,
) -> torch.Tensor:
    """Chunked gated delta rule on ``[1, T, H, D]`` inputs with a zero initial state for every sample:
    ``reference`` (transformers' torch implementation) runs once per group of samples of equal chunk count."""
    padded = [torch.cat([x[0], x.new_zeros(1, *x.shape[2:])]) for x in (query, key, value, g, beta)]
    outputs = []
    for index in layout.buckets:
        q, k, v, g_, b = (x[index] for x in padded)
        out, _ = reference(q, k, v, g=g_, beta=b, chunk_size=_CHUNK, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outputs.append(out.flatten(0, 1))
    return torch.cat(outputs)[layout.unbucket].unsqueeze(0)


# ------------------------------------------------------------------ the functions the layer calls by name


def _require_one_row(batch: int) -> None:
    if batch != 1:
        raise ValueError(f"a packed row must have batch size 1 (got {batch}): pack the micro-batch into one row")


@dataclass(frozen=True)
class _PackedConv:
    """Stands in for ``causal_conv1d_fn``: boundary-aware when ``cu_seq_lens_q`` is passed, original otherwise."""

    original: Callable
    reference: Callable
    backend: str

    def __call__(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            return self.original(hidden_states, weight, bias, activation=activation, **kwargs)
        _require_one_row(hidden_states.shape[0])
        backend = select_linear_backend(hidden_states.device) if self.backend == "auto" else self.backend
        if backend == "fla" and activation in _FLA_ACTIVATIONS:
            _check_covers(cu, hidden_states.shape[-1])
            conv = _fla_function("fla.modules.convolution", "causal_conv1d")
            out, _ = conv(hidden_states.transpose(1, 2).contiguous(), weight=weight, bias=bias,
                          activation=activation, cu_seqlens=cu.reshape(-1).to(torch.int32))
            return out.transpose(1, 2)
        layout = packed_layout(cu, hidden_states.shape[-1])
        return segmented_causal_conv1d(self.reference, hidden_states, weight, bias, activation, layout)


@dataclass(frozen=True)
class _PackedDeltaRule:
    """Stands in for ``torch_chunk_gated_delta_rule``: boundary-aware when ``cu_seqlens`` is passed."""

    original: Callable
    reference: Callable
    backend: str

    def __call__(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return self.original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                 output_final_state=output_final_state,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        if initial_state is not None or output_final_state:
            raise ValueError("a packed row cannot carry a recurrent-state cache: call the model with use_cache=False")
        _require_one_row(query.shape[0])
        backend = select_linear_backend(query.device) if self.backend == "auto" else self.backend
        if backend == "fla":
            _check_covers(cu_seqlens, query.shape[1])
            rule = _fla_function("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
            return rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        cu_seqlens=cu_seqlens.reshape(-1).to(torch.int32))
        layout = packed_layout(cu_seqlens, query.shape[1])
        out = segmented_gated_delta_rule(self.reference, query, key, value, g, beta, layout, use_qk_l2norm_in_kernel)
        return out, None


_covered: tuple[weakref.ref, int, int] | None = None


def _check_covers(cu: torch.Tensor, total: int) -> None:
    """fla route: the boundaries must span this row (a context-parallel shard is shorter). One sync per forward."""
    global _covered
    if _covered is not None and _covered[0]() is cu and _covered[1:] == (cu._version, total):
        return
    end = int(cu.reshape(-1)[-1])
    if end != total:
        raise ValueError(f"cu_seq_lens_q ends at {end} but the packed row has {total} tokens: "
                         + (CONTEXT_PARALLEL_REFUSAL if end > total else "pass the boundaries of this row"))
    _covered = (weakref.ref(cu), cu._version, total)


# ------------------------------------------------------------------ installing on one model's modules


_WRAPPERS = {CONV_FUNCTION: _PackedConv, RULE_FUNCTION: _PackedDeltaRule}


def _rebound_forward(cls: type, backend: str, functions: tuple[str, ...]) -> Callable:
    """``cls.forward``'s own code, with the kernel names in ``functions`` resolved in a private namespace to our
    versions."""
    inner = inspect.unwrap(cls.forward)
    names = set(inner.__code__.co_names)
    if not set(functions) <= names:
        raise NotImplementedError(
            f"{cls.__name__}.forward does not call {' and '.join(functions)} by name; this "
            "transformers version is not supported for packed linear attention"
        )
    namespace = dict(inner.__globals__)
    for name in functions:
        original = namespace[name]
        reference = inspect.unwrap(original)
        if reference.__name__ != name:
            raise NotImplementedError(f"{cls.__module__}.{name} does not unwrap to transformers' torch function")
        namespace[name] = _WRAPPERS[name](original, reference, backend)
    rebound = types.FunctionType(inner.__code__, namespace, inner.__name__, inner.__defaults__, inner.__closure__)
    rebound.__kwdefaults__ = inner.__kwdefaults__
    return rebound


def _packed_forward(rebound: Callable) -> Callable:
    """The layer forward to bind to each module (a bound method, so ``copy.deepcopy`` rebinds it to the copy).
    Its callers pass keywords (the DeltaNet's cache is ``cache_params``, LFM2's short conv's ``cache``)."""

    def forward(self, *args, **kwargs):
        if kwargs.get("cu_seq_lens_q") is not None:
            if kwargs.get("cache_params") is not None or kwargs.get("cache") is not None:
                raise ValueError("packed rows cannot fill a cache: call the model with use_cache=False")
            if kwargs.get("attention_mask") is not None:
                raise ValueError("a packed row got both cu_seq_lens_q and a padding attention_mask: drop "
                                 "attention_mask (packed rows carry their boundaries in cu_seq_lens_*)")
        return rebound(self, *args, **kwargs)

    forward.__vlm_pack_linear__ = True
    return forward


_checked_positions: tuple[weakref.ref, int] | None = None


def _require_boundary_kwargs(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on the layer that holds a DeltaNet: a packed row (position ids restarting inside a ``[1, T]`` row)
    without ``cu_seq_lens_q`` would run the DeltaNet across samples, so it is refused. One check per forward."""
    global _checked_positions
    positions = kwargs.get("position_ids")
    if (kwargs.get("cu_seq_lens_q") is not None or positions is None or positions.shape[0] != 1
            or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None):
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
    model: torch.nn.Module, class_names: Iterable[str], backend: str = "auto",
    functions: tuple[str, ...] = (CONV_FUNCTION, RULE_FUNCTION),
) -> list[torch.nn.Module]:
    """Give every submodule of ``model`` whose class is named in ``class_names`` a packed-row forward.

    ``functions``: the kernels its forward calls by name that must read the boundaries (a DeltaNet both; a
    short-convolution layer such as LFM2's ``Lfm2ShortConv`` only ``causal_conv1d_fn``).

    ``backend``: ``"auto"`` (fla for CUDA tensors when installed, else exact torch), ``"fla"`` or
    ``"torch_segments"``. Installing again replaces the previous install. Returns the modules changed.
    ``enable_packing`` runs this for the registered hybrid families (``vlm_pack.models.qwen3_5``).
    """
    if backend != "auto" and backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r}; choose 'auto' or one of {LINEAR_BACKENDS}")
    class_names = frozenset(class_names)
    remove_linear_attention_packing(model)
    rebound: dict[type, Callable] = {}
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    modules = [m for m in model.modules() if type(m).__name__ in class_names]
    for module in modules:
        hooked = [name for name, child in module.named_children() if getattr(child, "_hf_hook", None) is not None]
        if hooked:
            raise NotImplementedError(
                f"{type(module).__name__} has accelerate hooks on {hooked} (device_map offloading): packed linear "
                "attention supports models placed on one device; load without offloading"
            )
        cls = type(module)
        if cls not in rebound:
            rebound[cls] = _packed_forward(_rebound_forward(cls, backend, functions))
        module.forward = types.MethodType(rebound[cls], module)
        # The layer around the DeltaNet sees the position ids (the DeltaNet itself does not).
        module._vlm_pack_position_check = parents[module].register_forward_pre_hook(
            _require_boundary_kwargs, with_kwargs=True
        )
    return modules

