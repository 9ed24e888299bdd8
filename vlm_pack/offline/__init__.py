"""Offline packed SFT for LLMs: prepare packs once (``vlm-pack prepare``), then train on them (micro-batch 1).

* :mod:`.algorithms` - bin packing on a length array (first/best fit, decreasing/shuffled), millions per second;
* :mod:`.records` - reading the input (JSONL by line; parquet, CSV, Arrow, JSON arrays and ``save_to_disk``
  folders through ``datasets``);
* :mod:`.encoding` - TRL's dataset formats and tokenisation with loss masks (chat labels from the template's
  assistant spans);
* :mod:`.cache` - tokenised splits cached under a key of the input's CONTENT and every token-changing setting;
* :mod:`.output` - locked, atomic writes of a run into the output folder;
* :mod:`.storage` - the pickle-free, memory-mappable on-disk format, its metadata and checksums;
* :mod:`.verify` - ``vlm-pack verify DIR``: full, streamed integrity check of written packs;
* :mod:`.prepare` - tokenise + template + pack + write (:func:`prepare_packed_sequence_data`);
* :mod:`.dataset` - :class:`PackedSFTDataset` (reads packs, collates the packed-batch contract) and
  :class:`PackedDataset` (in-memory packing of a tokenised dataset for the Hugging Face ``Trainer``).

Names load on first use, so ``prepare`` on a warm cache and ``verify`` never import torch or transformers.
"""


from ..lazy_exports import lazy_getattr

_LAZY = {
    "ALGORITHMS": "algorithms",
    "PackingStats": "algorithms",
    "best_fit_decreasing": "algorithms",
    "best_fit_shuffle": "algorithms",
    "first_fit_decreasing": "algorithms",
    "first_fit_shuffle": "algorithms",
    "group_by_pack": "algorithms",
    "pack_lengths": "algorithms",
    "packing_stats": "algorithms",
    "PackedDataset": "dataset",
    "PackedSFTDataset": "dataset",
    "PrepareOptions": "prepare",
    "prepare_packed_sequence_data": "prepare",
    "PackedArrays": "storage",
    "open_packed": "storage",
    "read_metadata": "storage",
    "write_packed": "storage",
    "verify_packed": "verify",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
