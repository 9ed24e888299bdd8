"""Streaming token-budget packs: fixed-size packs from a dataset that only streams (``load_dataset(...,
streaming=True)``), exactly once per epoch across DataLoader workers and data-parallel ranks, resumable anywhere.

    shards --dealt per epoch (seeded order) to rank x worker units BEFORE packing: whole shards, the left-over
           ones split by example (any shard count)--> each unit: exact lengths (the token-budget planner's counts)
           --BufferedBestFit (bounded look-ahead)--> packs collated on the spot
    Trainer + StreamingPackCallback: every rank takes the same number of steps (loss-free packs once a rank's
    epoch is over; a data error on one rank stops every rank), and the units' states travel in each
    checkpoint's trainer_state.json with a fingerprint of the settings, restored (or refused) on resume.

Imports: ``core``, ``data``, ``integrations`` and the ``budget`` / ``offline`` paths beside it (floor 6 of
tests/test_layers.py); ``datasets`` and transformers where used. Nothing below imports it.
"""

from ..lazy_exports import lazy_getattr

_LAZY = {
    "BufferedBestFit": "packer",
    "StreamingPackDataset": "dataset",
    "StreamingPackCallback": "trainer",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
