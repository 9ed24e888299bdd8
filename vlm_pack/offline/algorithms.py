"""Bin packing of sample lengths into fixed-size packs, fast enough for tens of millions of samples.

Every algorithm takes a 1-D integer array of sample lengths and a pack size and returns a flat ``bin_ids``
array (int64, one pack index per sample, packs numbered 0..P-1 in the order they were opened). The flat form
is cheap for 10M samples and vectorises well; :func:`group_by_pack` turns it into (sample order, offsets).

Algorithms (all exact and deterministic; the shuffle variants for a given seed):

* ``first_fit_decreasing`` / ``first_fit_shuffle`` - samples by decreasing length (ties: dataset order) or in
  a uniformly random order drawn from ``seed`` (0 <= seed < 2**64; the same order on every machine and numpy
  version); each goes into the LOWEST-NUMBERED pack with room, a new pack if none.
* ``best_fit_decreasing`` / ``best_fit_shuffle`` - same orders; each goes into the FULLEST pack that still
  fits. Ties between packs with the same remaining room go to the pack that was filled most recently (any
  tie rule gives the same pack loads: best fit only looks at remaining room).

Both rules place one sample at a time in O(log) work, in a loop compiled by numba (a dependency: a random
order has no runs of equal lengths to vectorise, and a Python loop costs about 1 us per sample): first fit
descends a max tree over the remaining room of every potential pack (unopened packs are full leaves to the
right of the open ones, so "leftmost leaf with room" also opens packs in order); best fit looks up the
smallest sufficient room in a bitmap over room values 0..pack_size (lengths are integers <= pack_size) and
keeps, per room value, a linked stack of the packs with that room. The decreasing order needs no sort: it is
a run per length value, read back to dataset order in one pass. The random order is drawn bucket by bucket
(:func:`_shuffle_loop`) so that no pass jumps across the whole array. Working arrays are numpy arrays allocated
here, in the narrowest integer types that fit; timings and memory at 10M real lengths are in
``benchmarks/results/packing_cpu.md``. The loops are compiled on first use and cached on disk.

``naive_first_fit`` / ``naive_best_fit`` are the textbook quadratic versions of the same rules, kept as the
test oracle (tests/test_offline_algorithms.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compiled import compiled

ALGORITHMS = ("first_fit_decreasing", "first_fit_shuffle", "best_fit_decreasing", "best_fit_shuffle")

@dataclass(frozen=True)
class PackingStats:
    """Summary of one packing; ``packing_factor`` is the ``n`` users divide their global batch size by."""

    num_samples: int
    num_packs: int
    pack_size: int
    packing_factor: float  # samples per pack
    packing_efficiency: float  # percent of pack slots holding a real token
    max_samples_per_bin: int
    dataset_max_seqlen: int
    min_packed_seqlen: int


def check_pack_size(pack_size) -> int:
    """Validate a pack size (a Python or numpy integer >= 1, not a bool or float) and return it as an int."""
    if isinstance(pack_size, (bool, np.bool_)) or not isinstance(pack_size, (int, np.integer)):
        raise ValueError(f"pack_size must be an integer number of tokens, got {pack_size!r} "
                         f"({type(pack_size).__name__}); pass e.g. pack_size=4096")
    if pack_size < 1:
        raise ValueError(f"pack_size must be >= 1, got {pack_size}")
    return int(pack_size)


def check_seed(seed, name: str = "seed") -> int:
    """Validate a shuffle seed (an integer in [0, 2**64), not a bool) and return it as an int."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_lengths(lengths, pack_size: int) -> np.ndarray:
    """Validate a length array (1-D, integer, 1 <= length <= pack_size) and return it as int64."""
    pack_size = check_pack_size(pack_size)
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size == 0:
        return arr
    if arr.min() < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"sample {i} has length {arr[i]}; every sample needs at least one token (drop empty samples)")
    too_long = np.flatnonzero(arr > pack_size)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sample {i} has {arr[i]} tokens, more than the pack size {pack_size} "
            f"({too_long.size} sample(s) too long); "
            f"raise the pack size or truncate samples with max_seq_length <= {pack_size}"
        )
    return arr


def _max_bins(lengths: np.ndarray, pack_size: int) -> int:
    """Upper bound on packs opened by first or best fit: no two packs are both at most half full (the item that
    opened the later one would have fitted the earlier one), so all packs but one hold more than pack_size / 2."""
    return min(len(lengths), 2 * int(lengths.sum()) // pack_size + 2)


def _room_dtype(pack_size: int):
    return np.int16 if pack_size < 2**15 else np.int32 if pack_size < 2**31 else np.int64


def _in_decreasing_order(lengths: np.ndarray, pack_size: int, place) -> np.ndarray:
    """Run ``place`` over the samples by decreasing length, ties in dataset order; pack ids in dataset order.

    No sort: the decreasing sequence of lengths is a run of each length value (``np.repeat`` of a histogram),
    and a sample's position in it is where its length's run starts plus how many samples of the same length
    come before it in the dataset, which one sequential pass (:func:`_unsort_loop`) reads back.
    """
    if not len(lengths):
        return np.empty(0, dtype=np.int64)
    counts = np.bincount(lengths)
    values = np.arange(len(counts) - 1, -1, -1, dtype=_room_dtype(pack_size))
    placed = place(np.repeat(values, counts[::-1]), pack_size, _max_bins(lengths, pack_size))
    run_start = np.cumsum(counts[::-1])[::-1] - counts  # samples longer than each length
    bin_ids = np.empty(len(lengths), dtype=np.int64)
    compiled(_unsort_loop)(lengths, run_start, placed, bin_ids)
    return bin_ids


def _unsort_loop(lengths, run_start, placed, bin_ids):
    """``bin_ids[i]`` = the pack placed for sample i, found at the next free slot of its length's run."""
    for i in range(len(lengths)):
        length = lengths[i]
        bin_ids[i] = placed[run_start[length]]
        run_start[length] += 1


def _in_shuffled_order(lengths: np.ndarray, pack_size: int, seed: int, place) -> np.ndarray:
    """Run ``place`` over the samples in a uniformly random order drawn from ``seed``; pack ids in dataset order."""
    if not len(lengths):
        return np.empty(0, dtype=np.int64)
    needs, keys, ends, local = _shuffle(lengths.astype(_room_dtype(pack_size)), seed)
    placed = place(needs, pack_size, _max_bins(lengths, pack_size))
    bin_ids = np.empty(len(lengths), dtype=np.int64)
    compiled(_unshuffle_loop)(placed, keys, ends, local, bin_ids)
    return bin_ids


_SHUFFLE_BUCKET = 4096  # samples per bucket on average: a bucket's shuffle stays in the CPU cache


def _shuffle(values: np.ndarray, seed: int) -> tuple[np.ndarray, ...]:
    """``values`` in a uniformly random order drawn from ``seed``, plus what :func:`_unshuffle_loop` needs to
    map results back: (shuffled values, bucket of each value, bucket ends, in-bucket order).

    The same order on every machine and numpy version (own generator, see :func:`_shuffle_loop`), about 7x
    faster than ``Generator.shuffle`` at 10M samples, whose random accesses miss the cache on every swap.
    """
    check_seed(seed)
    n = len(values)
    key_bits = min(16, max(0, int(np.ceil(np.log2(max(n / _SHUFFLE_BUCKET, 1))))))
    keys = np.empty(n, dtype=np.uint16)
    ends = np.zeros(1 << key_bits, dtype=np.int64)
    needs = np.empty_like(values)
    local = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
    compiled(_shuffle_loop)(values, np.uint64(seed), key_bits, keys, ends, needs, local)
    return needs, keys, ends, local


def _shuffle_loop(values, seed, key_bits, keys, ends, needs, local):
    """A uniform random permutation in two cache-friendly passes (Rao-Sandelius): every value draws one of
    2**key_bits buckets, values are copied bucket by bucket (stable), then each bucket is Fisher-Yates shuffled
    on its own. ``needs`` gets the values in that order, ``keys`` each value's bucket, ``ends`` each bucket's
    end in ``needs``, ``local`` each position's index in its bucket's stable order.

    Random numbers: splitmix64 (a 64-bit counter through a mixing function) seeded with the mixed ``seed``;
    buckets from the top bits, Fisher-Yates picks by Lemire's multiply-and-reject (unbiased).
    """

    def mix(z):  # splitmix64's output function
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    golden = np.uint64(0x9E3779B97F4A7C15)
    low = np.uint64(0xFFFFFFFF)
    state = mix(seed)
    for i in range(len(values)):
        bucket = 0
        if key_bits:
            state += golden
            bucket = np.int64(mix(state) >> np.uint64(64 - key_bits))
        keys[i] = bucket
        ends[bucket] += 1
    widest, start = 0, 0
    for b in range(len(ends)):  # counts -> bucket starts, advanced to the ends by the copy below
        count = ends[b]
        ends[b] = start
        start += count
        widest = max(widest, count)
    for i in range(len(values)):
        needs[ends[keys[i]]] = values[i]
        ends[keys[i]] += 1
    scratch = np.empty_like(needs[:widest])
    lo = 0
    for b in range(len(ends)):
        m = ends[b] - lo
        for j in range(m):
            local[lo + j] = j
        for j in range(m - 1, 0, -1):  # position j takes a uniform pick of 0..j
            bound = np.uint64(j + 1)
            state += golden
            product = (mix(state) >> np.uint64(32)) * bound
            if (product & low) < bound:
                threshold = (np.uint64(2**32) - bound) % bound
                while (product & low) < threshold:
                    state += golden
                    product = (mix(state) >> np.uint64(32)) * bound
            pick = lo + np.int64(product >> np.uint64(32))
            local[lo + j], local[pick] = local[pick], local[lo + j]
        for j in range(m):
            scratch[j] = needs[lo + local[lo + j]]
        needs[lo:lo + m] = scratch[:m]
        lo += m


def _unshuffle_loop(placed, keys, ends, local, bin_ids):
    """``bin_ids[i]`` = the pack placed for value i of :func:`_shuffle_loop`: each bucket back to its stable order
    (in cache), then one pass reading every bucket front to back."""
    widest, lo = 0, 0
    for b in range(len(ends)):
        widest = max(widest, ends[b] - lo)
        lo = ends[b]
    scratch = np.empty_like(placed[:widest])
    lo = 0
    for b in range(len(ends)):
        for j in range(lo, ends[b]):
            scratch[local[j]] = placed[j]
        placed[lo:ends[b]] = scratch[:ends[b] - lo]
        ends[b], lo = lo, ends[b]  # the bucket's end becomes its start, for the pass below
    for i in range(len(keys)):
        bin_ids[i] = placed[ends[keys[i]]]
        ends[keys[i]] += 1


def _first_fit(needs: np.ndarray, pack_size: int, limit: int) -> np.ndarray:
    """Pack id of each of ``needs`` (lengths in processing order) by first fit (see :func:`_first_fit_loop`)."""
    sizes = [-(-limit // _FANOUT) * _FANOUT]  # leaf level: one room per potential pack
    while sizes[0] > 1:
        sizes.insert(0, -(-(sizes[0] // _FANOUT) // _FANOUT) * _FANOUT if sizes[0] > _FANOUT else 1)
    starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    tree = np.zeros(starts[-1], dtype=_room_dtype(pack_size))
    tree[starts[-2]:starts[-2] + limit] = pack_size  # padding leaves stay 0: never eligible
    for k in range(len(sizes) - 2, -1, -1):  # every node holds the largest room below it
        below = tree[starts[k + 1]:starts[k + 2]].reshape(-1, _FANOUT).max(axis=1)
        tree[starts[k]:starts[k] + len(below)] = below
    placed = np.empty(len(needs), dtype=np.int32 if limit < 2**31 else np.int64)
    _check_bound(compiled(_first_fit_loop)(needs, tree, starts, placed), limit)
    return placed


_FANOUT = 8  # children per node of the first-fit max tree (measured best of 4..32 at 10M lengths; 8 levels)


def _first_fit_loop(needs, tree, starts, placed):
    """Max tree stored level by level in ``tree`` (level k from ``starts[k]``; node j's children are j*8..j*8+7
    of the next level; the last level holds every potential pack's room); returns the packs opened, or -1."""
    fanout = _FANOUT
    last = len(starts) - 2
    leaves = starts[last]
    opened = 0
    for t in range(len(needs)):
        need = needs[t]
        if tree[0] < need:
            return -1
        j = 0
        for k in range(1, last + 1):  # descend: the leftmost child with room >= need, level by level
            base = starts[k] + j * fanout
            c = 0
            while tree[base + c] < need:
                c += 1
            j = j * fanout + c
        tree[leaves + j] -= need
        placed[t] = j
        opened = max(opened, j + 1)
        for k in range(last - 1, -1, -1):  # refresh the maxima above; stop where nothing changes
            j //= fanout
            base = starts[k + 1] + j * fanout
            best = tree[base]
            for c in range(1, fanout):
                best = max(best, tree[base + c])
            if tree[starts[k] + j] == best:
                break
            tree[starts[k] + j] = best
    return opened


def _best_fit(needs: np.ndarray, pack_size: int, limit: int) -> np.ndarray:
    """Pack id of each of ``needs`` (lengths in processing order) by best fit (see :func:`_best_fit_loop`)."""
    index = np.int32 if limit < 2**31 else np.int64
    words = np.zeros(pack_size // 64 + 1, dtype=np.uint64)  # bit r % 64 of word r // 64: a pack has room r
    top = np.full(pack_size + 1, -1, dtype=index)  # per room value: the pack that got it last, -1 if none
    below = np.empty(limit, dtype=index)  # per pack: the next pack down its room's stack
    placed = np.empty(len(needs), dtype=index)
    _check_bound(compiled(_best_fit_loop)(needs, pack_size, words, top, below, placed), limit)
    return placed


def _best_fit_loop(needs, pack_size, words, top, below, placed):
    """Bitmap of the room values some open pack has, plus a stack of packs per room value (linked through
    ``below``); returns the number of packs opened, or -1 if ``below`` ran out."""
    one = np.uint64(1)
    opened = 0
    for t in range(len(needs)):
        need = np.int64(needs[t])
        room = need  # smallest room >= need that some open pack has, or -1
        bits = words[need >> 6] >> np.uint64(need & 63)
        if not bits:
            for v in range((need >> 6) + 1, len(words)):
                if words[v]:
                    bits, room = words[v], v << 6
                    break
        if bits:
            while not bits & one:
                bits >>= one
                room += 1
        else:
            room = -1
        if room < 0:  # nothing fits: open a pack
            if opened == len(below):
                return -1
            b = opened
            opened += 1
            room = pack_size
        else:  # pop the most recently filled pack with that room
            b = top[room]
            top[room] = below[b]
            if top[room] < 0:
                words[room >> 6] &= ~(one << np.uint64(room & 63))
        placed[t] = b
        room -= need
        if room > 0:  # push it onto the stack of its new room
            below[b] = top[room]
            top[room] = b
            words[room >> 6] |= one << np.uint64(room & 63)
    return opened


def _check_bound(opened: int, limit: int) -> None:
    if opened < 0:
        raise RuntimeError(f"packing opened more than the proven bound of {limit} packs; please report this bug")


def first_fit_decreasing(lengths, pack_size: int) -> np.ndarray:
    """First fit over samples sorted by decreasing length; returns the pack id of every sample."""
    lengths, pack_size = check_lengths(lengths, pack_size), check_pack_size(pack_size)
    return _in_decreasing_order(lengths, pack_size, _first_fit)


def best_fit_decreasing(lengths, pack_size: int) -> np.ndarray:
    """Best fit over samples sorted by decreasing length; returns the pack id of every sample."""
    lengths, pack_size = check_lengths(lengths, pack_size), check_pack_size(pack_size)
    return _in_decreasing_order(lengths, pack_size, _best_fit)


def first_fit_shuffle(lengths, pack_size: int, seed: int = 0) -> np.ndarray:
    """First fit over the samples in a random order drawn from ``seed``."""
    lengths, pack_size = check_lengths(lengths, pack_size), check_pack_size(pack_size)
    return _in_shuffled_order(lengths, pack_size, seed, _first_fit)


def best_fit_shuffle(lengths, pack_size: int, seed: int = 0) -> np.ndarray:
    """Best fit over the samples in a random order drawn from ``seed``."""
    lengths, pack_size = check_lengths(lengths, pack_size), check_pack_size(pack_size)
    return _in_shuffled_order(lengths, pack_size, seed, _best_fit)


_FUNCTIONS = {
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "best_fit_decreasing": best_fit_decreasing,
    "best_fit_shuffle": best_fit_shuffle,
}


def pack_lengths(lengths, pack_size: int, algorithm: str = "first_fit_decreasing", seed: int = 0) -> np.ndarray:
    """Run the named algorithm (one of :data:`ALGORITHMS`); ``seed`` only matters for the shuffle variants."""
    if algorithm not in _FUNCTIONS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    fn = _FUNCTIONS[algorithm]
    return fn(lengths, pack_size, seed=seed) if algorithm.endswith("_shuffle") else fn(lengths, pack_size)


def group_by_pack(bin_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Samples grouped by pack: ``order`` (dataset order inside each pack) and pack ``offsets`` into it."""
    bin_ids = np.asarray(bin_ids, dtype=np.int64)
    order = np.argsort(bin_ids, kind="stable")
    counts = np.bincount(bin_ids) if len(bin_ids) else np.zeros(0, dtype=np.int64)
    return order, np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def packing_stats(lengths, bin_ids: np.ndarray, pack_size: int) -> PackingStats:
    """Loads, packing factor and efficiency of an assignment (the fields of the ``<size>_metadata.jsonl``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bin_ids = np.asarray(bin_ids, dtype=np.int64)
    if len(lengths) == 0:
        return PackingStats(0, 0, pack_size, 0.0, 0.0, 0, 0, 0)
    loads = np.bincount(bin_ids, weights=lengths).astype(np.int64)
    per_bin = np.bincount(bin_ids)
    return PackingStats(
        num_samples=len(lengths),
        num_packs=len(loads),
        pack_size=int(pack_size),
        packing_factor=len(lengths) / len(loads),
        packing_efficiency=100.0 * float(loads.sum()) / (len(loads) * pack_size),
        max_samples_per_bin=int(per_bin.max()),
        dataset_max_seqlen=int(lengths.max()),
        min_packed_seqlen=int(loads.min()),
    )


def naive_first_fit(lengths, pack_size: int) -> np.ndarray:
    """Textbook quadratic first fit in the given order (the test oracle)."""
    loads: list[int] = []
    out = []
    for length in np.asarray(lengths).tolist():
        for b, load in enumerate(loads):
            if load + length <= pack_size:
                loads[b] += length
                out.append(b)
                break
        else:
            loads.append(length)
            out.append(len(loads) - 1)
    return np.asarray(out, dtype=np.int64)


def naive_best_fit(lengths, pack_size: int) -> np.ndarray:
    """Textbook quadratic best fit in the given order: the fullest pack that fits; among equally full packs,
    the one that received an item most recently (the tie rule of the fast versions)."""
    loads: list[int] = []
    last: list[int] = []  # per pack: position of its latest item
    out = []
    for t, length in enumerate(np.asarray(lengths).tolist()):
        best = -1
        for b, load in enumerate(loads):
            if load + length <= pack_size and (best < 0 or (load, last[b]) > (loads[best], last[best])):
                best = b
        if best < 0:
            loads.append(0)
            last.append(t)
            best = len(loads) - 1
        loads[best] += length
        last[best] = t
        out.append(best)
    return np.asarray(out, dtype=np.int64)
