"""Shared plumbing of vlm_pack's packed linear-attention layers: backends, the per-sample layout, the causal conv.

Recurrent layers (Gated DeltaNet, LFM2's short convolution, Mamba-2) carry context along the row in a short causal
depthwise conv over the last ``K - 1`` tokens and, for the first and last, a recurrent state. In a packed row both
must start from zero at every boundary, or sample i+1 reads sample i. Boundaries come from the forward kwarg
``cu_seq_lens_q`` (``PackedBatch.attention_kwargs()``), which transformers forwards to these layers.

vlm_pack computes these layers itself from their parameters and config fields (``gated_deltanet``, ``short_conv``,
``mamba2``; installed by ``packed_layers``), never by calling or rebinding the stock forward's inner functions,
whose names change between releases (transformers 5.25 moved the conv into ``causal_conv1d_forward``).

Backends (``LINEAR_BACKENDS``), chosen per call like the attention backends:

* ``"fla"``: flash-linear-attention's varlen kernels (``causal_conv1d(..., cu_seqlens=)``,
  ``chunk_gated_delta_rule(..., cu_seqlens=)``): CUDA, optional, imported at run time;
* ``"torch_segments"``: exact everywhere: the conv over a row with ``K - 1`` zeros in front of each sample, the
  recurrences over a batch of samples grouped by their number of 64-token chunks (each sample zero-filled to whole
  chunks after its end, which a causal recurrence never reads). One host sync per forward, shared by all layers.

Context parallelism is refused: a rank holding zigzag chunks would need the recurrent and conv state of the
chunks before it (a state hand-off between ranks, not implemented).
"""

from __future__ import annotations

import importlib
import importlib.util
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "ACTIVATIONS",
    "CONTEXT_PARALLEL_REFUSAL",
    "LINEAR_BACKENDS",
    "SegmentLayout",
    "causal_conv1d",
    "fla_error",
    "packed_causal_conv1d",
    "packed_layout",
    "parameter_shapes",
    "resolve_backend",
    "segmented_causal_conv1d",
    "select_linear_backend",
]

LINEAR_BACKENDS: tuple[str, ...] = ("fla", "torch_segments")
"""Backend names ``install_linear_attention_packing`` accepts (besides ``"auto"``)."""

CHUNK = 64
"""Tokens per chunk of the torch recurrences (any size gives the same result; samples are grouped by chunk count)."""

ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda x: x, "silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu}
"""Conv activations (config names) the packed layers compute; any other is refused at install."""
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


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``backend`` with ``"auto"`` resolved for tensors on ``device``."""
    return select_linear_backend(device) if backend == "auto" else backend


_FLA_FUNCTIONS = (("fla.modules.convolution", "causal_conv1d"), ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"))


def fla_function(module: str, name: str) -> Callable:
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
        chunks = -(-lengths // CHUNK)
        device = cu_seqlens.device
        buckets, unbucket, offset = [], np.empty(total, dtype=np.int64), 0
        for count in np.unique(chunks[lengths > 0]):
            members = np.flatnonzero((chunks == count) & (lengths > 0))
            width = int(count) * CHUNK
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


def parameter_shapes(module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, tuple[int, ...]] | None:
    """Shapes of ``module``'s parameters by dotted name (``"conv1d.weight"``), or None if one is missing. Read by
    attribute, so a layer wrapped by an adapter (PEFT LoRA exposes its base layer's ``weight``) still resolves."""
    shapes = {}
    for name in names:
        value = module
        for part in name.split("."):
            value = getattr(value, part, None)
        if not isinstance(value, torch.Tensor):
            return None
        shapes[name] = tuple(value.shape)
    return shapes


# ------------------------------------------------------------------ the causal depthwise conv


def causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None) -> torch.Tensor:
    """Causal depthwise conv of ``[B, C, T]`` with ``weight [C, K]``: output t reads inputs t-K+1..t (zeros before
    the start), computed in the weight's dtype, returned in the input's."""
    out = torch.nn.functional.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias,
                                     padding=weight.shape[-1] - 1, groups=weight.shape[0])
    return ACTIVATIONS[activation](out[..., :hidden_states.shape[-1]]).to(hidden_states.dtype)


def segmented_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            activation: str | None, layout: SegmentLayout) -> torch.Tensor:
    """:func:`causal_conv1d` of a packed ``[1, C, T]`` row restarted per sample: run over a row with ``K - 1`` zeros
    before every sample."""
    positions, width = layout.conv_positions(weight.shape[-1])
    spaced = hidden_states.new_zeros(*hidden_states.shape[:2], width).index_copy(2, positions, hidden_states)
    return causal_conv1d(spaced, weight, bias, activation).index_select(2, positions)


def packed_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None, cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
    """The conv of a packed ``[1, C, T]`` row, window restarted at every boundary of ``cu_seqlens``, on ``backend``."""
    require_one_row(hidden_states.shape[0])
    if resolve_backend(backend, hidden_states.device) == "fla" and activation in _FLA_ACTIVATIONS:
        check_covers(cu_seqlens, hidden_states.shape[-1])
        conv = fla_function("fla.modules.convolution", "causal_conv1d")
        out, _ = conv(hidden_states.transpose(1, 2).contiguous(), weight=weight, bias=bias, activation=activation,
                      cu_seqlens=cu_seqlens.reshape(-1).to(torch.int32))
        return out.transpose(1, 2)
    return segmented_causal_conv1d(hidden_states, weight, bias, activation,
                                   packed_layout(cu_seqlens, hidden_states.shape[-1]))


def require_one_row(batch: int) -> None:
    """A packed row is one row: refuse a batch of several."""
    if batch != 1:
        raise ValueError(f"a packed row must have batch size 1 (got {batch}): pack the micro-batch into one row")


_covered: tuple[weakref.ref, int, int] | None = None


def check_covers(cu: torch.Tensor, total: int) -> None:
    """fla route: the boundaries must span this row (a context-parallel shard is shorter). One sync per forward."""
    global _covered
    if _covered is not None and _covered[0]() is cu and _covered[1:] == (cu._version, total):
        return
    end = int(cu.reshape(-1)[-1])
    if end != total:
        raise ValueError(f"cu_seq_lens_q ends at {end} but the packed row has {total} tokens: "
                         + (CONTEXT_PARALLEL_REFUSAL if end > total else "pass the boundaries of this row"))
    _covered = (weakref.ref(cu), cu._version, total)
