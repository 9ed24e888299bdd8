"""The batch contract shared by every producer (``VLMPackingCollator``, ``PackedSFTDataset``, ``PackedDataset``).

A batch is MODEL-READY: ``model(**batch)`` (what ``transformers.Trainer`` and TRL do) is a correct forward for
every registered family. At the top level it holds only forward arguments, under Hugging Face names:
``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k`` and the processor's vision
tensors. Packing bookkeeping that is not a forward argument (real ``cu_seqlens``, ``cu_seqlens_padded``,
``seq_lengths``, ``stats``, Megatron's ``loss_mask`` / ``cu_seqlens_argmin`` / ``max_seqlen``) lives in ONE
namespaced entry, ``batch[METADATA_KEY]``, a plain dict (Trainer and DataLoader pinning rebuild dicts, so an
attribute would be lost; a dict travels and its tensors are moved to the device with the rest). Every HF forward
takes ``**kwargs`` and no module reads this name, so the entry is inert (proven per family in
tests/test_trainer.py); ``model_inputs(batch)`` drops it for custom loops.

Labels are safe for the model's OWN loss: the first label slot of every sample is -100, so a loss that shifts
over the whole row (HF's ``ForCausalLMLoss``, TRL's fused head, ``vlm_pack.compute_loss_func``) never predicts
across a boundary, and Trainer's ``num_items_in_batch`` (non -100 labels) counts exactly the targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .packing import IGNORE_INDEX

__all__ = ["METADATA_KEY", "mask_first_labels", "model_inputs", "packing_metadata"]

METADATA_KEY = "vlm_pack"
"""The one batch key that holds packing bookkeeping (never a forward argument of any transformers model)."""


def model_inputs(batch: Mapping[str, Any], *, keep_labels: bool = False) -> dict[str, Any]:
    """The batch entries to pass as ``model(**...)`` in a custom loop: all but the metadata (and the labels)."""
    drop = {METADATA_KEY} if keep_labels else {METADATA_KEY, "labels"}
    return {key: value for key, value in batch.items() if key not in drop}


def packing_metadata(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch[METADATA_KEY]`` (empty dict when the batch carries none)."""
    return dict(batch.get(METADATA_KEY) or {})


def mask_first_labels(labels: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Set the label at each sample start of a packed row ``[1, T]`` to -100 (in place; returns ``labels``).

    The first token of a sample is never a target in unpacked training, so this changes no exact loss; it keeps
    a whole-row shift from predicting the next sample's first token.
    """
    labels[..., starts.long()] = IGNORE_INDEX
    return labels
