"""vlm_pack's own packed forward of a Mamba-2 mixer (transformers' ``NemotronHMamba2Mixer``: nemotron_h and
nemotron_h_omni), conv window and SSM state restarted at every sample boundary.

Computed from the mixer's parameters (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
``out_proj``) and its config's ``mamba_num_heads`` / ``mamba_head_dim`` / ``n_groups`` / ``ssm_state_size`` /
``mamba_hidden_act``: ``in_proj`` gives gate ``z``, ``xBC`` and ``dt``; the causal conv (with activation) runs over
``xBC``; the selective scan, per head ``h`` with state ``H`` of ``[head_dim, state]``::

    dt_t = clamp(softplus(dt_t + dt_bias), *time_step_limit),   a_t = -exp(A_log) dt_t
    H_t = exp(a_t) H_{t-1} + (dt_t x_t) B_t^T,   y_t = H_t C_t + D x_t

(each of the ``n_groups`` B / C groups serves consecutive heads); then the layer's own gated ``norm(y, z)`` and
``out_proj``. The dt clamp is read from the module's ``time_step_limit`` (transformers <= 5.24 clamps below at
``config.time_step_min``, 5.25 at ``config.time_step_limit``): what the stock layer of the installed release does.
The scan runs in torch on every device (mamba_ssm's varlen kernels are not wired); the conv takes fla's varlen
conv on CUDA when installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .linear import ACTIVATIONS, CHUNK, SegmentLayout, packed_causal_conv1d, packed_layout, parameter_shapes

__all__ = ["Mamba2Shape", "chunk_selective_scan", "mamba2_forward", "segmented_selective_scan"]

_CONFIG_FIELDS = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "mamba_hidden_act")


@dataclass(frozen=True)
class Mamba2Shape:
    """The dimensions of one Mamba-2 mixer, from its config, checked against its parameters."""

    heads: int
    head_dim: int
    groups: int
    state: int
    activation: str
    time_step_limit: tuple[float, float]

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @classmethod
    def of(cls, module: torch.nn.Module, config: Any) -> "Mamba2Shape | None":
        """The shape of ``module`` if its parameters are a Mamba-2 mixer's (else None); raises when they do not
        match ``config``."""
        names = parameter_shapes(module, ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                                          "out_proj.weight"))
        if names is None:
            return None
        missing = [f for f in _CONFIG_FIELDS if getattr(config, f, None) is None]
        limit = getattr(module, "time_step_limit", None)
        if missing or limit is None:
            raise NotImplementedError(f"{type(module).__name__}: config lacks {missing} or the module its "
                                      "time_step_limit; packed Mamba-2 reads them")
        shape = cls(config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size,
                    config.mamba_hidden_act, (float(limit[0]), float(limit[1])))
        conv = shape.inner + 2 * shape.groups * shape.state
        expected = {"in_proj.weight": shape.inner + conv + shape.heads, "conv1d.weight": conv,
                    "dt_bias": shape.heads, "A_log": shape.heads, "D": shape.heads, "norm.weight": shape.inner}
        wrong = {name: names[name] for name, rows in expected.items() if names[name][0] != rows}
        if wrong or shape.heads % shape.groups or shape.activation not in ACTIVATIONS:
            raise NotImplementedError(
                f"{type(module).__name__}: parameters {wrong or ''} / activation {shape.activation!r} do not match "
                f"a Mamba-2 mixer of {shape} (rows expected {expected}); packed Mamba-2 does not know this layout")
        return shape


def mamba2_forward(module: torch.nn.Module, shape: Mamba2Shape, hidden_states: torch.Tensor,
                   cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
    """The mixer's output on a packed ``[1, T, hidden]`` row, conv window and SSM state restarted per sample."""
    batch, length, _ = hidden_states.shape
    dtype = hidden_states.dtype
    conv_width = shape.inner + 2 * shape.groups * shape.state
    gate, xbc, dt = module.in_proj(hidden_states).split([shape.inner, conv_width, shape.heads], dim=-1)
    conv = module.conv1d
    xbc = packed_causal_conv1d(xbc.transpose(1, 2), conv.weight.squeeze(1), conv.bias, shape.activation,
                               cu_seqlens, backend).transpose(1, 2)
    x, b, c = xbc.split([shape.inner, shape.groups * shape.state, shape.groups * shape.state], dim=-1)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).clamp(*shape.time_step_limit)
    y = segmented_selective_scan(
        x.reshape(batch, length, shape.heads, shape.head_dim), dt, -module.A_log.float().exp(),
        b.reshape(batch, length, shape.groups, shape.state), c.reshape(batch, length, shape.groups, shape.state),
        module.D, packed_layout(cu_seqlens, length))
    y = module.norm(y.reshape(batch, length, shape.inner), gate)
    return module.out_proj(y.to(dtype))


def segmented_selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                             d: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """:func:`chunk_selective_scan` of a packed ``[1, T, ...]`` row, once per group of samples of equal chunk count
    (each from a zero state)."""
    padded = [torch.cat([t[0], t.new_zeros(1, *t.shape[2:])]) for t in (x, dt, b, c)]
    outputs = [chunk_selective_scan(*(t[index] for t in padded[:2]), a, *(t[index] for t in padded[2:]), d)
               .flatten(0, 1) for index in layout.buckets]
    return torch.cat(outputs)[layout.unbucket].unsqueeze(0)


def chunk_selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         d: torch.Tensor) -> torch.Tensor:
    """The Mamba-2 scan of ``x [B, T, H, P]`` with step ``dt [B, T, H]`` (after softplus and clamp), decay rate
    ``a [H]`` (negative), ``b, c [B, T, G, N]`` and skip ``d [H]``, from a zero state, in fp32, ``CHUNK`` tokens at a
    time. Returns ``[B, T, H, P]`` fp32.

    Within a chunk with cumulative log decay ``L`` (of ``a dt``) and chunk-start state ``H0``:
    ``y_t = exp(L_t) H0 C_t + sum_{s<=t} exp(L_t - L_s) (C_t . B_s) dt_s x_s + D x_t`` and
    ``H_end = exp(L_end) H0 + sum_s exp(L_end - L_s) dt_s x_s B_s^T``.
    """
    batch, length, heads, head_dim = x.shape
    per_group = heads // b.shape[2]
    x, dt = x.float(), dt.float()
    b, c = (t.float().repeat_interleave(per_group, dim=2) for t in (b, c))
    skip = d.float()[:, None] * x
    pad = -length % CHUNK
    chunks = (length + pad) // CHUNK
    # [B, H, chunks, CHUNK, ...]
    x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(batch, chunks, CHUNK, heads, -1).permute(0, 3, 1, 2, 4)
               for t in (x, b, c))
    dt = F.pad(dt, (0, 0, 0, pad)).reshape(batch, chunks, CHUNK, heads).permute(0, 3, 1, 2)
    cum = (a.float()[None, :, None, None] * dt).cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    inputs = x * dt.unsqueeze(-1)
    mixing = c @ b.transpose(-1, -2) * decay  # [t, s]
    write = b * (cum[..., -1:] - cum).exp().unsqueeze(-1)

    state = x.new_zeros(batch, heads, b.shape[-1], head_dim)  # [N, P]
    out = torch.empty_like(x)
    for k in range(chunks):
        out[:, :, k] = (c[:, :, k] * cum[:, :, k, :, None].exp()) @ state + mixing[:, :, k] @ inputs[:, :, k]
        state = state * cum[:, :, k, -1, None, None].exp() + write[:, :, k].transpose(-1, -2) @ inputs[:, :, k]
    out = out.permute(0, 2, 3, 1, 4).reshape(batch, chunks * CHUNK, heads, head_dim)[:, :length]
    return out + skip
