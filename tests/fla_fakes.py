"""Recording fakes of flash-linear-attention's two varlen entry points, bound to their real signatures.

fla cannot stay installed here: with it, transformers' Qwen3.5 modules call its Triton kernels on CPU tensors and
fail. The fakes check fla's shape rules, record every call and return zeros of the right shape, so the tests can
check what vlm_pack's "fla" route hands the kernels (cu_seqlens, layouts, flags) on a CPU machine.
"""

from __future__ import annotations

import sys
import types

import torch


class Recorder:
    """Fake fla function: records what it is passed, returns zeros of the right shape."""

    def __init__(self, make_output):
        self.calls: list[dict] = []
        self.make_output = make_output

    def __call__(self, *args, **kwargs):
        self.calls.append({"args": args, **kwargs})
        return self.make_output(*args, **kwargs)


# flash-linear-attention 0.6.0's signatures (read from the installed package with inspect.signature).
def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                               cp_context=None, **kwargs):
    """fla's shape rules: q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (grouped values, fla >= 0.5);
    g, beta [B, T, HV]; varlen needs B == 1."""
    assert not kwargs, f"unknown keywords {sorted(kwargs)}"
    assert q.shape == k.shape and v.shape[:2] == q.shape[:2] and v.shape[2] % q.shape[2] == 0
    assert g.shape == beta.shape == v.shape[:3]
    assert cu_seqlens is None or q.shape[0] == 1
    return torch.zeros_like(v), None


def fla_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                      cp_context=None, **kwargs):
    """fla's rules: x [B, T, D], weight [D, W]; returns (y, final_state)."""
    assert not kwargs, f"unknown keywords {sorted(kwargs)}"
    assert x.dim() == 3 and weight.shape[0] == x.shape[-1]
    return torch.zeros_like(x), None


def install_fake_fla(monkeypatch):
    """flash-linear-attention's two varlen entry points as recording fakes with the real signatures."""
    rule = Recorder(fla_chunk_gated_delta_rule)
    conv = Recorder(fla_causal_conv1d)
    modules = {
        "fla": types.ModuleType("fla"),
        "fla.ops": types.ModuleType("fla.ops"),
        "fla.ops.gated_delta_rule": types.SimpleNamespace(chunk_gated_delta_rule=rule),
        "fla.modules": types.ModuleType("fla.modules"),
        "fla.modules.convolution": types.SimpleNamespace(causal_conv1d=conv),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return rule, conv
