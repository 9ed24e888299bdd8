"""Attention rule "a prefix shared by two continuations" (preference pairs with the prompt packed once).

A pair ``(prompt, chosen, rejected)`` is packed as two segments: ``A = prompt + chosen`` and
``B = prompt[-1] + rejected``. ``B`` restates the prompt's last token (same id, same position) so that its hidden
state, which scores the rejected answer's first token, is that of the prompt's last token; ``B`` must then see the
prompt's other tokens (``A[:Lp-1]``), never ``A``'s own continuation. Positions of ``B`` continue from the prompt.

The rule is expressed as KEYS, not as a mask: segment ``B``'s keys are ``A[:Lp-1]`` followed by ``B``, gathered
once per layer with one ``index_select``. Causal attention is bottom-right aligned in every ``varlen_attention``
backend (the query of ``B`` at index ``i`` sees virtual keys ``0 .. Lp-1+i``), so the per-segment SDPA path (CPU,
exact), FlexAttention (document mask with ``cu_seqlens_q != cu_seqlens_k``) and the CUDA varlen kernels all run
it unchanged; the prefix's keys are read twice, its projections, MLPs and vision encoder run once.

The collator puts a :func:`shared_prefix_keys` dict under the forward kwarg ``SHARED_PREFIX_KWARG``;
``vlm_pack.integrations.hf_model.packing_attention_forward`` applies it to causal calls on the packed row (vision towers and other
calls are left alone). Image blocks (Gemma 3) need self-attention segments and are refused with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = ["SHARED_PREFIX_KWARG", "gather_shared_keys", "shared_prefix_keys"]

SHARED_PREFIX_KWARG = "vlm_pack_shared_prefix"
"""Forward kwarg carrying the key layout of a row whose pairs share their prompt (a plain dict of tensors)."""


def shared_prefix_keys(lengths: Sequence[int], prefixes: Sequence[tuple[int, int]]) -> dict[str, torch.Tensor | int]:
    """Key layout for a packed row of segments ``lengths``; ``prefixes[s] = (start, length)``: row slots segment
    ``s`` also sees before its own tokens (``(0, 0)`` for none).

    Returns ``{"key_index": [Tk] row slot of each virtual key, "cu_seqlens_k": [N+1] int32, "max_length_k": int,
    "row_length": T}``.
    """
    if len(prefixes) != len(lengths):
        raise ValueError(f"one prefix per segment: got {len(prefixes)} prefixes for {len(lengths)} segments")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    pieces, key_lengths = [], []
    for s, (length, (start, size)) in enumerate(zip(lengths, prefixes)):
        if size and not (0 <= start and start + size <= starts[s]):
            raise ValueError(f"segment {s}: its prefix [{start}, {start + size}) must lie before the segment")
        pieces += [np.arange(start, start + size), np.arange(starts[s], starts[s] + length)]
        key_lengths.append(size + length)
    cu_k = np.concatenate([[0], np.cumsum(key_lengths)])
    return {
        "key_index": torch.from_numpy(np.concatenate(pieces).astype(np.int64)),
        "cu_seqlens_k": torch.from_numpy(cu_k.astype(np.int32)),
        "max_length_k": int(max(key_lengths)),
        "row_length": int(starts[-1]),
    }


def gather_shared_keys(
    shared: Mapping[str, torch.Tensor | int], key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``[B=1, Hkv, T, D]`` key / value of the packed row -> (virtual key, value, cu_seqlens_k, max_length_k)."""
    if key.shape[0] != 1 or key.shape[2] != int(shared["row_length"]):
        raise ValueError(
            f"{SHARED_PREFIX_KWARG} describes a row of {int(shared['row_length'])} tokens but the attention got keys "
            f"of shape {tuple(key.shape)}: the shared-prompt layout belongs to one packed row (micro-batch 1)"
        )
    index = shared["key_index"].to(key.device)
    return key.index_select(2, index), value.index_select(2, index), shared["cu_seqlens_k"], int(shared["max_length_k"])
