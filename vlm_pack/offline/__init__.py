"""Offline packed SFT for LLMs: prepare packs once (``vlm-pack prepare``), then train on them (micro-batch 1).

* :mod:`.algorithms` - bin packing on a length array (first/best fit, decreasing/shuffled), millions per second;
* :mod:`.storage` - the pickle-free, memory-mappable on-disk format and its metadata;
* :mod:`.prepare` - tokenise + template + pack + write (:func:`prepare_packed_sequence_data`);
* :mod:`.dataset` - :class:`PackedSFTDataset` (reads packs, collates the packed-batch contract) and
  :class:`PackedDataset` (in-memory packing of a tokenised dataset for the Hugging Face ``Trainer``).
"""

from .algorithms import (
    ALGORITHMS,
    PackingStats,
    best_fit_decreasing,
    best_fit_shuffle,
    first_fit_decreasing,
    first_fit_shuffle,
    group_by_pack,
    pack_lengths,
    packing_stats,
)
from .dataset import PackedDataset, PackedSFTDataset
from .prepare import prepare_packed_sequence_data
from .storage import PackedArrays, open_packed, read_metadata, write_packed

__all__ = [
    "ALGORITHMS",
    "PackedArrays",
    "PackedDataset",
    "PackedSFTDataset",
    "PackingStats",
    "best_fit_decreasing",
    "best_fit_shuffle",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "group_by_pack",
    "open_packed",
    "pack_lengths",
    "packing_stats",
    "prepare_packed_sequence_data",
    "read_metadata",
    "write_packed",
]
