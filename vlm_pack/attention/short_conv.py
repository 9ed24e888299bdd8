"""vlm_pack's own packed forward of a gated short-convolution layer (LFM2 / LFM2-VL ``Lfm2ShortConv``).

Computed from the layer's parameters alone: ``in_proj`` gives ``B``, ``C``, ``x`` (thirds of its output, in that
order); the causal depthwise ``conv`` (no activation) runs over ``B * x`` with its window restarted at every sample
boundary; ``out_proj`` maps ``C * conv``. Dimensions come from the parameter shapes (``in_proj`` ``[3 D, D]``,
``conv`` ``[D, 1, K]``, ``out_proj`` ``[D, D]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .linear import packed_causal_conv1d, parameter_shapes

__all__ = ["ShortConvShape", "short_conv_forward"]


@dataclass(frozen=True)
class ShortConvShape:
    """The width and conv window of one short-convolution layer, read from its parameters."""

    width: int
    kernel: int

    @classmethod
    def of(cls, module: torch.nn.Module, config: Any = None) -> "ShortConvShape | None":
        """The shape of ``module`` if its parameters are a short conv's (``in_proj``, ``conv``, ``out_proj``), else
        None; raises when they are but their shapes do not fit together."""
        names = parameter_shapes(module, ("in_proj.weight", "conv.weight", "out_proj.weight"))
        if names is None:
            return None
        width, kernel = names["conv.weight"][0], names["conv.weight"][-1]
        expected = {"in_proj.weight": (3 * width, width), "conv.weight": (width, 1, kernel),
                    "out_proj.weight": (width, width)}
        wrong = {name: shape for name, shape in names.items() if shape != expected[name]}
        if wrong:
            raise NotImplementedError(f"{type(module).__name__}: parameters {wrong} are not a short conv's "
                                      f"{expected}; packed linear attention does not know this layout")
        return cls(width, kernel)


def short_conv_forward(module: torch.nn.Module, shape: ShortConvShape, hidden_states: torch.Tensor,
                       cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
    """The layer's output on a packed ``[1, T, D]`` row, conv window restarted per sample."""
    b, c, x = module.in_proj(hidden_states).transpose(1, 2).chunk(3, dim=1)
    conv = packed_causal_conv1d(b * x, module.conv.weight.squeeze(1), module.conv.bias, None, cu_seqlens, backend)
    return module.out_proj((c * conv).transpose(1, 2).contiguous())
