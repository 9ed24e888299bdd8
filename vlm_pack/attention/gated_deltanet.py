"""vlm_pack's own packed forward of a Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, MiniCPM-V 4.6 / 4.7).

Computed from the layer's parameters and its config's ``linear_*`` fields, as flash-linear-attention's layers are:
project, causal depthwise conv (restarted per sample), gated delta rule (zero state per sample), gated RMSNorm (the
layer's own ``norm`` submodule), output projection. Two parameter layouts are known, told apart by parameter name:

* ``split`` (Qwen3.5): ``in_proj_qkv`` (q, k, v concatenated), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
* ``grouped`` (Qwen3-Next): ``in_proj_qkvz`` and ``in_proj_ba`` with every key head's q, k, its value heads' v and
  z (and b, a) side by side.

The gated delta rule, per value head, state ``S`` of ``[d_k, d_v]`` (q, k L2-normalized, q scaled by
``d_k ** -0.5``; each key head serves ``H_v / H_k`` consecutive value heads)::

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) k_t^T S_{t-1}),    o_t = q_t^T S_t
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .linear import (
    ACTIVATIONS, CHUNK, SegmentLayout, check_covers, fla_function, packed_causal_conv1d, packed_layout,
    parameter_shapes, require_one_row, resolve_backend,
)

__all__ = ["DeltaNetShape", "chunk_gated_delta_rule", "deltanet_forward", "packed_gated_delta_rule",
           "segmented_gated_delta_rule"]

_CONFIG_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "hidden_act")


@dataclass(frozen=True)
class DeltaNetShape:
    """The dimensions of one Gated DeltaNet layer, read from its config and checked against its parameters."""

    layout: str  # "split" or "grouped"
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    activation: str

    @classmethod
    def of(cls, module: torch.nn.Module, config: Any) -> "DeltaNetShape | None":
        """The shape of ``module`` if its parameters are a Gated DeltaNet's (else None); raises when they do not
        match ``config`` (a layout vlm_pack does not know)."""
        common = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
        split = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
        grouped = ("in_proj_qkvz.weight", "in_proj_ba.weight")
        names = parameter_shapes(module, common + split) or parameter_shapes(module, common + grouped)
        if names is None:
            return None
        missing = [f for f in _CONFIG_FIELDS if getattr(config, f, None) is None]
        if missing:
            raise NotImplementedError(f"{type(module).__name__}: its config lacks {missing}; packed Gated DeltaNet "
                                      "reads them (pass the text config that built the layer)")
        shape = cls("split" if split[0] in names else "grouped", config.linear_num_key_heads,
                    config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
                    config.hidden_act)
        keys, values = shape.key_heads * shape.key_head_dim, shape.value_heads * shape.value_head_dim
        expected = {"conv1d.weight": (2 * keys + values, 1, config.linear_conv_kernel_dim),
                    "A_log": (shape.value_heads,), "dt_bias": (shape.value_heads,),
                    "norm.weight": (shape.value_head_dim,)}
        if shape.layout == "split":
            expected |= {"in_proj_qkv.weight": (2 * keys + values, -1), "in_proj_z.weight": (values, -1),
                         "in_proj_b.weight": (shape.value_heads, -1), "in_proj_a.weight": (shape.value_heads, -1)}
        else:
            expected |= {"in_proj_qkvz.weight": (2 * keys + 2 * values, -1),
                         "in_proj_ba.weight": (2 * shape.value_heads, -1)}
        wrong = {name: names[name] for name, want in expected.items()
                 if len(want) != len(names[name]) or any(w not in (-1, s) for w, s in zip(want, names[name]))}
        if wrong or shape.value_heads % shape.key_heads or shape.activation not in ACTIVATIONS:
            raise NotImplementedError(
                f"{type(module).__name__}: parameters {wrong or ''} / activation {shape.activation!r} do not match "
                f"a Gated DeltaNet of {shape} (expected {expected}); packed linear attention does not know this layout")
        return shape


def _project(module: torch.nn.Module, shape: DeltaNetShape, hidden: torch.Tensor):
    """Mixed q|k|v ``[B, T, 2 K + V]`` (the conv's input), gate ``z`` ``[B, T, H_v, d_v]`` and ``b``, ``a``
    ``[B, T, H_v]``, from either parameter layout."""
    batch, length, _ = hidden.shape
    if shape.layout == "split":
        z = module.in_proj_z(hidden).reshape(batch, length, shape.value_heads, shape.value_head_dim)
        return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)
    group = shape.value_heads // shape.key_heads
    qkvz = module.in_proj_qkvz(hidden).reshape(batch, length, shape.key_heads, -1)
    values = group * shape.value_head_dim
    q, k, v, z = qkvz.split([shape.key_head_dim, shape.key_head_dim, values, values], -1)
    b, a = module.in_proj_ba(hidden).reshape(batch, length, shape.key_heads, 2 * group).split([group, group], -1)
    mixed = torch.cat([x.reshape(batch, length, -1) for x in (q, k, v)], -1)
    z = z.reshape(batch, length, shape.value_heads, shape.value_head_dim)
    return mixed, z, b.reshape(batch, length, -1), a.reshape(batch, length, -1)


def deltanet_forward(module: torch.nn.Module, shape: DeltaNetShape, hidden_states: torch.Tensor,
                     cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
    """The layer's output on a packed ``[1, T, hidden]`` row, conv window and recurrent state restarted per sample."""
    batch, length, _ = hidden_states.shape
    mixed, z, b, a = _project(module, shape, hidden_states)
    conv = module.conv1d
    mixed = packed_causal_conv1d(mixed.transpose(1, 2), conv.weight.squeeze(1), conv.bias, shape.activation,
                                 cu_seqlens, backend).transpose(1, 2)
    keys = shape.key_heads * shape.key_head_dim
    q, k, v = mixed.split([keys, keys, shape.value_heads * shape.value_head_dim], -1)
    q = q.reshape(batch, length, shape.key_heads, shape.key_head_dim)
    k = k.reshape(batch, length, shape.key_heads, shape.key_head_dim)
    v = v.reshape(batch, length, shape.value_heads, shape.value_head_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # fp32: exp(A_log) overflows fp16
    out = packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens, backend)
    out = module.norm(out, z)
    return module.out_proj(out.reshape(batch, length, -1))


def packed_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
    """The gated delta rule (q, k L2-normalized) of a packed ``[1, T, H, D]`` row, state zero at every boundary."""
    require_one_row(q.shape[0])
    if resolve_backend(backend, q.device) == "fla":
        check_covers(cu_seqlens, q.shape[1])
        rule = fla_function("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
        out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.reshape(-1).to(torch.int32))
        return out
    return segmented_gated_delta_rule(q, k, v, g, beta, packed_layout(cu_seqlens, q.shape[1]))


def segmented_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """:func:`chunk_gated_delta_rule` of a packed ``[1, T, ...]`` row, run once per group of samples of equal chunk
    count (each from a zero state)."""
    padded = [torch.cat([x[0], x.new_zeros(1, *x.shape[2:])]) for x in (q, k, v, g, beta)]
    outputs = [chunk_gated_delta_rule(*(x[index] for x in padded)).flatten(0, 1) for index in layout.buckets]
    return torch.cat(outputs)[layout.unbucket].unsqueeze(0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule of ``[B, T, H_k, d_k]`` q, k, ``[B, T, H_v, d_v]`` v, ``[B, T, H_v]`` g (log decay) and
    beta, from a zero state, in fp32, ``CHUNK`` tokens at a time. Returns ``[B, T, H_v, d_v]`` in v's dtype.

    Within a chunk with cumulative log decay ``G`` and chunk-start state ``S0``, the deltas
    ``u_t = beta_t (v_t - k_t^T S_{t-1} exp(g_t))`` solve ``(I + A) u = beta V - beta exp(G) K S0`` with
    ``A[t, j] = beta_t exp(G_t - G_j) k_t . k_j`` (j < t); then ``o_t = exp(G_t) q_t S0 + sum_{j<=t}
    exp(G_t - G_j) (q_t . k_j) u_j`` and ``S_end = exp(G_end) S0 + sum_j exp(G_end - G_j) k_j u_j^T``.
    """
    batch, length, key_heads, key_head_dim = k.shape
    value_heads, dtype = v.shape[2], v.dtype
    if value_heads != key_heads:
        q, k = (x.repeat_interleave(value_heads // key_heads, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [B, H, T, D]
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))  # [B, H, T]
    q, k = _l2norm(q) * key_head_dim ** -0.5, _l2norm(k)
    pad = -length % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK
    q, k, v = (x.reshape(batch, value_heads, chunks, CHUNK, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, value_heads, chunks, CHUNK) for x in (g, beta))

    cum = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [t, j]: G_t - G_j
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(CHUNK, device=q.device)
    deltas_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    deltas_s = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                             unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay
    read = q * cum.exp().unsqueeze(-1)
    write = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)

    state = q.new_zeros(batch, value_heads, key_head_dim, v.shape[-1])
    out = torch.empty_like(v)
    for c in range(chunks):
        deltas = deltas_v[:, :, c] - deltas_s[:, :, c] @ state
        out[:, :, c] = read[:, :, c] @ state + scores[:, :, c] @ deltas
        state = state * cum[:, :, c, -1, None, None].exp() + write[:, :, c].transpose(-1, -2) @ deltas
    out = out.reshape(batch, value_heads, chunks * CHUNK, -1)[:, :, :length]
    return out.transpose(1, 2).to(dtype)
