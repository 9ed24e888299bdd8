"""Patch indices per sample: processor outputs whose values number the patches of another output over the WHOLE
processor call (``VisionRows.patch_indices``; Molmo 2's ``image_token_pooling`` into ``pixel_values``).

A processor call numbers the flattened patches (dims 0 and 1 of the patch tensor) of all its samples together, so a
sample's share of such a tensor points at patches whose numbers depend on the samples encoded before it (or dropped
from the batch). :func:`localize` makes each sample's indices its own, counted from its first patch;
:func:`join` concatenates samples, re-basing each by the patches of the samples before it, so a packed (or padded)
batch reads exactly the patches each sample reads alone. ``-1`` (no patch) stays ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["join", "localize"]


def _patches(source: torch.Tensor | None) -> int:
    """Flattened patches (dims 0 and 1) of one sample's share of the patch tensor."""
    return 0 if source is None else source.shape[0] * source.shape[1]


def localize(indices: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor | None], key: str,
             source_key: str) -> list[torch.Tensor | None]:
    """Each sample's ``indices`` (numbered over the whole call, samples in order) counted from its own first patch
    of ``sources``; an index outside the sample's own patches is an error naming the sample."""
    out, offset = [], 0
    for index, (values, source) in enumerate(zip(indices, sources)):
        count = _patches(source)
        if values is not None:
            local = torch.where(values >= 0, values - offset, values)
            if ((values >= 0) & ((local < 0) | (local >= count))).any():
                raise ValueError(
                    f"sample {index}: processor output {key!r} indexes patches outside the sample's own {count} "
                    f"{source_key!r} patches, so they cannot follow it into a packed row (processor and model family "
                    "do not match)"
                )
            out.append(local)
        else:
            out.append(None)
        offset += count
    return out


def join(indices: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The samples' own ``indices`` (:func:`localize`) concatenated in sample order, each re-based by the patches of
    ``sources`` of the samples before it."""
    parts, offset = [], 0
    for values, source in zip(indices, sources):
        if values is not None:
            parts.append(torch.where(values >= 0, values + offset, values))
        offset += _patches(source)
    return torch.cat(parts)
