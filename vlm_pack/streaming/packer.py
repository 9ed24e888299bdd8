"""Buffered best fit: fixed-size packs from a stream of sample lengths, with a bounded look-ahead.

Samples enter a buffer of at most ``buffer_size``; once it is full (or the stream ended) one pack is cut:

* the opener is the sample that has waited longest if it has waited ``buffer_size`` packs (so no sample waits
  unboundedly and a resume re-reads a bounded window), else one drawn from the buffer with a generator seeded by
  ``(seed, epoch, unit, pack index)`` (the seeded shuffle: a different order every epoch, the same for a seed);
* then, while some buffered sample fits the room left, the LONGEST one that fits joins (best fit).

Every sample lands in exactly one pack and none is cut; a sample longer than the pack is an error. The state is
small (the buffered samples' keys, lengths and entry pack) and fully describes what comes next, so
:meth:`BufferedBestFit.state_dict` / :meth:`BufferedBestFit.load_state_dict` resume exactly.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["STATE_FORMAT", "BufferedBestFit", "BufferedSample", "predict_fill"]

STATE_FORMAT = "vlm_pack.stream_state/2"
"""The stream state's format tag (saved by ``StreamingPackCallback``, checked on restore by the dataset)."""

Key = tuple[int, int]  # (position of the shard in the unit's shard list, row in the shard)


@dataclass(frozen=True)
class BufferedSample:
    """One waiting sample: where it was read, its aligned length, the pack count when it entered."""

    key: Key
    length: int
    entered: int


class BufferedBestFit:
    """Packs of at most ``pack_size`` slots from samples offered one at a time (see the module doc)."""

    def __init__(self, pack_size: int, buffer_size: int, seed: tuple[int, ...]) -> None:
        if pack_size < 1 or buffer_size < 1:
            raise ValueError(f"pack_size and buffer_size must be >= 1; got {pack_size}, {buffer_size}")
        self.pack_size = pack_size
        self.buffer_size = buffer_size
        self.seed = tuple(int(s) for s in seed)
        self.packs = 0  # packs cut so far
        self._waiting: dict[Key, BufferedSample] = {}  # insertion order = arrival order
        self._by_length: list[tuple[int, Key]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def full(self) -> bool:
        return len(self._waiting) >= self.buffer_size

    def add(self, key: Key, length: int, entered: int | None = None) -> None:
        if length > self.pack_size:
            raise ValueError(f"a sample of {length} tokens does not fit pack_size={self.pack_size}")
        sample = BufferedSample(key, int(length), self.packs if entered is None else int(entered))
        self._waiting[key] = sample
        insort(self._by_length, (sample.length, key))

    def cut(self) -> list[BufferedSample]:
        """Cut one pack from the buffer (which must not be empty); its samples in concatenation order."""
        oldest = next(iter(self._waiting.values()))
        if self.packs - oldest.entered >= self.buffer_size:
            opener = oldest
        else:
            rng = np.random.default_rng((*self.seed, self.packs))
            opener = self._waiting[self._by_length[int(rng.integers(len(self._by_length)))][1]]
        pack = [self._remove(opener)]
        room = self.pack_size - opener.length
        while self._by_length and self._by_length[0][0] <= room:
            at = bisect_right(self._by_length, (room, (2**62, 2**62))) - 1
            chosen = self._remove(self._waiting[self._by_length[at][1]])
            pack.append(chosen)
            room -= chosen.length
        self.packs += 1
        return pack

    def count_packs(self, lengths: Iterable[int]) -> int:
        """Offer ``lengths`` in stream order (keys ``(0, i)``), cutting whenever the buffer is full, then drain it:
        the number of packs cut. The stream's pack count without its samples (fill predictions, benchmarks)."""
        start = self.packs
        for i, length in enumerate(lengths):
            self.add((0, i), int(length))
            if self.full:
                self.cut()
        while len(self):
            self.cut()
        return self.packs - start

    def _remove(self, sample: BufferedSample) -> BufferedSample:
        del self._waiting[sample.key]
        at = bisect_right(self._by_length, (sample.length, sample.key)) - 1
        del self._by_length[at]
        return sample

    def waiting(self) -> list[BufferedSample]:
        """The buffered samples in arrival order."""
        return list(self._waiting.values())

    def state_dict(self) -> dict:
        return {"packs": self.packs,
                "waiting": [[s.key[0], s.key[1], s.length, s.entered] for s in self._waiting.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.packs = int(state["packs"])
        self._waiting, self._by_length = {}, []
        for shard, row, length, entered in state["waiting"]:
            self.add((int(shard), int(row)), int(length), int(entered))


def predict_fill(lengths, pack_size: int, buffer_size: int, samples: int = 2048, seed: int = 0) -> tuple[float, float]:
    """(fill of buffered best fit at ``buffer_size``, fill of offline best fit decreasing) on ``samples`` lengths
    drawn from ``lengths`` (a stream's first measured samples): what the buffer will give, beside the best
    possible. Fill = tokens / (packs x pack size)."""
    from ..offline.algorithms import best_fit_decreasing

    rng = np.random.default_rng(seed)
    drawn = rng.choice(np.asarray(lengths, dtype=np.int64), size=samples)
    packs = BufferedBestFit(pack_size, buffer_size, (seed,)).count_packs(drawn.tolist())
    tokens = float(drawn.sum()) / pack_size
    return tokens / packs, tokens / (int(best_fit_decreasing(drawn, pack_size).max()) + 1)
