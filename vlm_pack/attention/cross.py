"""Cross-attention over a packed row: each sample's text attends only to its OWN media keys.

Models that attend from text to separately encoded media (Mllama's cross-attention layers: every text token to the
vision states of its sample's images) concatenate the media of every sample of a packed row into one key sequence.
Exactness needs each sample's queries to see exactly the keys it sees alone: its own key segment (``cu_k``), with
the model's own mask inside it; a sample without media has an empty segment, and its queries output 0 (the model
skips its cross-attention layers when a sample alone has no media). A family hook hands the segments down as the
``CROSS_KEYS_KWARG`` forward kwarg (a :class:`CrossKeys`); the attention layers it marks (``CROSS_ATTENTION_FLAG``)
route to :func:`segment_cross_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["CROSS_ATTENTION_FLAG", "CROSS_KEYS_KWARG", "CrossKeys", "segment_cross_attention"]

CROSS_KEYS_KWARG = "vlm_pack_cross_keys"
"""Forward kwarg carrying a :class:`CrossKeys` from the family's model class down to its cross-attention layers."""
CROSS_ATTENTION_FLAG = "vlm_pack_cross_attention"
"""Attribute a family hook sets (True) on its cross-attention modules."""


@dataclass(eq=False)
class CrossKeys:
    """Media items (images) per packed segment, in row order; every item contributes the same number of keys."""

    items_per_segment: list[int]

    def boundaries(self, keys: int) -> list[int]:
        """Key offsets ``[N + 1]`` of the segments in a key sequence of ``keys`` (all items' keys, in order)."""
        total = sum(self.items_per_segment)
        if total == 0 or keys % total:
            raise ValueError(f"cross-attention keys ({keys}) are not a whole number per media item ({total} items)")
        per_item, offsets = keys // total, [0]
        for items in self.items_per_segment:
            offsets.append(offsets[-1] + items * per_item)
        return offsets


def segment_cross_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                            cu_q: torch.Tensor, keys: CrossKeys, scale: float | None) -> torch.Tensor:
    """``[1, Hq, T, D]`` queries against ``[1, Hkv, K, D]`` keys, each packed segment only against its own keys
    (``mask``: the model's additive or boolean ``[1, 1|H, T, K]`` mask, sliced per segment); ``[1, T, Hq, Dv]``."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1; got query of shape {tuple(query.shape)}")
    bounds_q = cu_q.reshape(-1).tolist()
    bounds_k = keys.boundaries(key.shape[2])
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"{len(bounds_q) - 1} packed segments but media keys for {len(bounds_k) - 1}")
    out = query.new_zeros(1, query.shape[1], query.shape[2], value.shape[-1])
    gqa = query.shape[1] != key.shape[1]
    for (qs, qe), (ks, ke) in zip(zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_k[:-1], bounds_k[1:])):
        if qe == qs or ke == ks:  # no media in this sample: its queries output 0
            continue
        piece = None if mask is None else mask[..., qs:qe, ks:ke]
        out[:, :, qs:qe] = F.scaled_dot_product_attention(query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke],
                                                          attn_mask=piece, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
