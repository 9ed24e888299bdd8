"""Tolerances of the exactness proofs: derived from the fp32 noise floor measured where the test runs.

A packed fp32 forward and the stock fp32 forward of one sample alone are two roundings of the same exact function.
They run the same operations in different shapes (one row of several samples vs one sample), so matrix-multiply
blocking and reduction order differ, and so do the last bits. How far apart two such roundings land depends on
the CPU (SIMD width, reduction order), the model's depth and the values' magnitude: a constant tuned on one machine
fails on the next. So each proof measures the floor on its own samples: the stock reference run in fp64 (exact, to
fp32's eyes) against the same reference in fp32. The fp32 reference sits ``floor`` away from the exact value; a
correct packed result, another fp32 rounding, sits about as far on its own side, so it may be up to
``NOISE_FACTOR * floor`` from the fp32 reference::

    exact (fp64) ----- floor ----- stock fp32          packed fp32 within NOISE_FACTOR x floor of stock fp32
                 \\---- ~floor ---- packed fp32         a boundary / position / mask bug: 1e-2 .. 1e+1 away

The floor never drops below one fp32 ulp of the largest magnitude (``FP32_EPS * max|exact|``), so an fp32 run that
happens to be exact does not make the bound zero. Every rule's corruption test shows errors 3-7 orders of magnitude
above these bounds, so the margin costs no power.

Gradients use a stated bound instead of an fp64 backward pass (which would double the cost of every proof):
relative L2 error per parameter tensor below ``GRAD_REL_L2`` (1e-4, ~840 fp32 ulps; the stock model's own fp32
gradients are ~1e-7 .. 1e-6 from fp64 on these tiny models, and a dropped boundary is 1e-2 or worse).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch

FP32_EPS = torch.finfo(torch.float32).eps
NOISE_FACTOR = 16.0
GRAD_REL_L2 = 1e-4
SMALL_GRAD_FRACTION = 1e-3


def fp64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same stock model in float64: the exact reference the fp32 floor is measured against. Mixture-of-experts
    blocks run their plain per-expert loop (``torch._grouped_mm`` has no float64 kernel); configs say float64 (a
    forward that casts its inputs to ``config.dtype``, as Nemotron-H Omni's vision features, then stays float64)."""
    copied = copy.deepcopy(model).double()
    for module in copied.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
        if getattr(config, "dtype", None) == torch.float32:
            config.dtype = torch.float64
    return copied


def fp64_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Floating tensors (pixel values, ...) of a forward's keyword arguments in float64; the rest unchanged."""
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


@dataclass
class NoiseFloor:
    """Largest gap between the fp32 and the fp64 run of the stock reference over every value observed."""

    what: str
    value: float = 0.0

    def observe(self, fp32: torch.Tensor, fp64: torch.Tensor) -> None:
        exact = fp64.detach().double()
        gap = (fp32.detach().double() - exact).abs().max().item() if exact.numel() else 0.0
        ulp = FP32_EPS * exact.abs().max().item() if exact.numel() else 0.0
        self.value = max(self.value, gap, ulp)

    @property
    def tolerance(self) -> float:
        assert self.value > 0, f"{self.what}: no fp64 reference observed, the floor is unknown"
        return NOISE_FACTOR * self.value

    def check(self, error: float, context: str = "") -> None:
        """Assert a packed-vs-reference error lies within the measured noise."""
        where = f" ({context})" if context else ""
        assert error <= self.tolerance, (
            f"{self.what}{where}: |packed - stock fp32| = {error:.3g} > {NOISE_FACTOR:g} x fp32 noise floor "
            f"{self.value:.3g} (stock fp32 vs fp64 on these samples)")

    def is_far(self, error: float, factor: float = 10.0) -> bool:
        """For corruption tests: the error is far outside the noise (``factor`` x the tolerance)."""
        return error > factor * self.tolerance


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def grad_errors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Relative L2 error of every parameter's gradient against the reference's (the same parameters).

    A tensor holding less than SMALL_GRAD_FRACTION of the largest reference gradient norm is measured against
    that fraction instead of its own norm: such a gradient is zero in exact arithmetic (a key bias: softmax is
    invariant to it) and both sides hold only rounding noise."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    largest = max((w.double().norm().item() for w in want.values()), default=0.0)
    errors = {}
    for name, grad in got.items():
        reference = want[name].double()
        scale = max(reference.norm().item(), SMALL_GRAD_FRACTION * largest)
        errors[name] = (grad.double() - reference).norm().item() / scale if scale > 0 else 0.0
    return errors


def assert_grads_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Every parameter's gradient within GRAD_REL_L2 relative L2 of the reference's (see ``grad_errors``)."""
    for name, error in grad_errors(got, want).items():
        assert error < GRAD_REL_L2, f"gradient of {name}: relative L2 error {error:.3g} >= {GRAD_REL_L2:g}"
