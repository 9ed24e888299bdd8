"""Bin packing of sample lengths into fixed-size packs, fast enough for millions of samples.

Every algorithm takes a 1-D integer array of sample lengths and a pack size and returns a flat ``bin_ids``
array (int64, one pack index per sample, packs numbered 0..P-1 in the order they were opened). The flat form
is cheap for 10M samples and vectorises well; :func:`group_by_pack` turns it into (sample order, offsets).

Algorithms (all exact, deterministic for a seed):

* ``first_fit_decreasing`` - samples by decreasing length (ties: dataset order), each into the leftmost pack
  with room. Sorted lengths come in runs of equal length (at most pack_size distinct values), and first fit
  places a run of identical items by filling the eligible packs left to right, so a whole run is placed at
  once: a 64-ary max tree over remaining capacities (numpy arrays, one per level) finds the leftmost eligible
  packs level by level, keeping only as many candidates as the run needs. O(n + D * depth) numpy calls
  (D = distinct lengths), no per-item Python work.
* ``best_fit_decreasing`` - same order, each sample into the fullest pack that still fits. Best fit only
  depends on how many packs have each remaining capacity (integers 0..pack_size), so a run of identical
  items is placed with one vectorised pass over a count-per-capacity array.
* ``first_fit_shuffle`` / ``best_fit_shuffle`` - the same rules in a seeded random order (packs of mixed
  lengths). A random order has no runs, so these place one sample at a time with O(log) work: a binary max
  tree in a Python list (first fit; early exit on the way up) and a two-level bitmap over capacities (best
  fit): about 1-3 us per sample in CPython, the slow pair.

The decreasing variants fall back to the item-by-item loops when runs are short (few samples per distinct
length, e.g. 10k samples): same result, less overhead.

Ties between packs with the same remaining capacity in best fit go to the pack that reached that capacity
last; any tie rule gives the same pack loads, because best fit only looks at capacities.

``naive_first_fit`` / ``naive_best_fit`` are the textbook quadratic versions, kept as the oracle for tests and
the baseline of ``benchmarks/packing.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("first_fit_decreasing", "first_fit_shuffle", "best_fit_decreasing", "best_fit_shuffle")

_BRANCHING = 64  # children per node of the vectorised max tree: few levels, so few numpy calls per run


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


def check_lengths(lengths, pack_size: int) -> np.ndarray:
    """Validate a length array (1-D, integer, 1 <= length <= pack_size) and return it as int64."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    if int(pack_size) < 1:
        raise ValueError(f"pack_size must be >= 1, got {pack_size}")
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
    """Upper bound on packs used by any first/best-fit variant: all packs but one are more than half full."""
    return min(len(lengths), 2 * int(lengths.sum()) // pack_size + 2)


def _decreasing_runs(lengths: np.ndarray, pack_size: int):
    """Sample indices by decreasing length (stable), and the start offsets of runs of equal length."""
    key = (pack_size - lengths).astype(np.uint16 if pack_size < 2**16 else np.int64)
    order = np.argsort(key, kind="stable")  # radix sort for 16-bit keys: O(n)
    sorted_len = lengths[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_len)) + 1, [len(order)]))
    return order, sorted_len, starts


def _decreasing(lengths, pack_size: int, by_runs, in_order) -> np.ndarray:
    """Shared driver of the ``*_decreasing`` variants: whole runs of equal lengths when that pays off.

    Whole-run placement (``by_runs``) costs ~20 us of numpy calls per run, item by item (``in_order``) ~1-2 us
    per item; both give the same packs.
    """
    lengths = check_lengths(lengths, pack_size)
    if len(lengths) == 0:
        return np.empty(0, dtype=np.int64)
    order, sorted_len, starts = _decreasing_runs(lengths, pack_size)
    if len(lengths) <= 16 * (len(starts) - 1):  # 16 items or fewer per run: item by item is cheaper
        return in_order(lengths, order, pack_size)
    return by_runs(lengths, order, sorted_len, starts, pack_size)


def _shuffled(lengths, pack_size: int, seed: int, in_order) -> np.ndarray:
    """Shared driver of the ``*_shuffle`` variants: one item at a time in a random order drawn from ``seed``."""
    lengths = check_lengths(lengths, pack_size)
    order = np.random.default_rng(seed).permutation(len(lengths))
    return in_order(lengths, order, pack_size)


def first_fit_decreasing(lengths, pack_size: int) -> np.ndarray:
    """First fit over samples sorted by decreasing length; returns the pack id of every sample."""
    return _decreasing(lengths, pack_size, _first_fit_by_runs, _first_fit_in_order)


def _first_fit_by_runs(lengths, order, sorted_len, starts, pack_size: int) -> np.ndarray:
    """First fit decreasing, one run of equal lengths at a time (see :class:`_CapacityTree`)."""
    bin_ids = np.empty(len(lengths), dtype=np.int64)
    tree = _CapacityTree(_max_bins(lengths, pack_size), pack_size)
    for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
        bin_ids[order[s:e]] = tree.place_run(int(sorted_len[s]), e - s)
    return bin_ids


class _CapacityTree:
    """B-ary max tree over the remaining capacity of every potential pack, one numpy array per level.

    Unopened packs are leaves at full capacity to the right of the open ones, so "leftmost leaf with room"
    also opens new packs in order. Padding leaves hold 0 (never eligible: lengths are >= 1).
    """

    def __init__(self, num_leaves: int, pack_size: int):
        dtype = np.int16 if pack_size < 2**15 else np.int32
        self.levels: list[np.ndarray] = []
        size = num_leaves
        while True:
            level = np.zeros(-(-size // _BRANCHING) * _BRANCHING, dtype=dtype)
            level[:size] = pack_size
            self.levels.append(level)
            if size == 1:
                break
            size = len(level) // _BRANCHING
        self.blocks = [level.reshape(-1, _BRANCHING) for level in self.levels]  # views: one row per parent

    def place_run(self, length: int, count: int) -> np.ndarray:
        """Place ``count`` items of one ``length`` by first fit; return their leaf ids in placement order."""
        b, accumulate = _BRANCHING, np.add.accumulate
        if count == 1:
            return self._place_one(length)
        nodes = np.zeros(1, dtype=np.int64)  # the root
        for blocks in reversed(self.blocks[:-1]):
            if len(nodes) == 1:  # common near the root: one row, no fancy indexing
                row = blocks[nodes[0]]
                pos = np.flatnonzero(row >= length)
                cap, child = row[pos], pos + nodes[0] * b
            else:
                rows = blocks[nodes]
                pos = np.flatnonzero(rows >= length)
                cap, child = rows.ravel()[pos], nodes[pos // b] * b + pos % b
            # an eligible subtree takes at least cap // length items: keep just enough of them, in order
            nodes = child[: int(np.searchsorted(accumulate(cap // length), count)) + 1]
        leaves = self.levels[0]
        fit = leaves[nodes] // length
        before = accumulate(fit) - fit
        take = np.minimum(fit, count - before)
        nodes, take = nodes[take > 0], take[take > 0]
        leaves[nodes] -= (take * length).astype(leaves.dtype)
        placed = np.repeat(nodes, take)
        for lower, upper in zip(self.blocks[:-1], self.levels[1:]):  # refresh the ancestors' maxima
            nodes = nodes // b  # sorted; a repeated parent just gets the same value twice
            upper[nodes] = lower[nodes].max(axis=1)
        return placed

    def _place_one(self, length: int) -> np.ndarray:
        """Scalar path of :meth:`place_run` for a single item (frequent in the long tail of lengths)."""
        node = 0
        for blocks in reversed(self.blocks[:-1]):
            node = node * _BRANCHING + int(np.argmax(blocks[node] >= length))
        leaf = node
        self.levels[0][leaf] -= length
        for lower, upper in zip(self.blocks[:-1], self.levels[1:]):
            node //= _BRANCHING
            upper[node] = lower[node].max()
        return np.array([leaf], dtype=np.int64)


def best_fit_decreasing(lengths, pack_size: int) -> np.ndarray:
    """Best fit over samples sorted by decreasing length; returns the pack id of every sample."""
    return _decreasing(lengths, pack_size, _best_fit_by_runs, _best_fit_in_order)


def _best_fit_by_runs(lengths, order, sorted_len, starts, pack_size: int) -> np.ndarray:
    """Best fit decreasing, one run of equal lengths at a time, over counts of packs per remaining capacity.

    A pack at capacity ``c`` (the fullest that fits) takes ``c // length`` items of the run in a row; then the
    next fullest. Ties are taken most recent first, exactly as the item-by-item version does.
    """
    bin_ids = np.empty(len(lengths), dtype=np.int64)
    packs = _PacksByCapacity(pack_size)
    for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
        length, todo = int(sorted_len[s]), e - s
        caps = np.flatnonzero(packs.count[length:pack_size]) + length  # eligible capacities, fullest first
        per_pack = caps // length
        room = np.cumsum(packs.count[caps] * per_pack)
        last = int(np.searchsorted(room, todo)) if len(room) else 0
        ids, takes = [], []
        for cap, q in zip(caps[: last + 1].tolist(), per_pack[: last + 1].tolist()):
            if todo == 0:
                break
            full, part = divmod(min(todo, int(packs.count[cap]) * q), q)
            packs.fill(packs.pop(cap, full + (part > 0)), cap, length, q, full, part, ids, takes)
            todo -= full * q + part
        if todo:  # open new packs, each taking as many items as fit
            q = pack_size // length
            full, part = divmod(todo, q)
            packs.fill(packs.new(full + (part > 0)), pack_size, length, q, full, part, ids, takes)
        bin_ids[order[s:e]] = np.repeat(np.concatenate(ids), np.concatenate(takes))
    return bin_ids


class _PacksByCapacity:
    """Open packs grouped by remaining capacity: counts (for vectorised search) and a stack of pack ids each."""

    def __init__(self, pack_size: int):
        self.count = np.zeros(pack_size + 1, dtype=np.int64)
        self.stacks: list[list[int]] = [[] for _ in range(pack_size + 1)]
        self.opened = 0

    def pop(self, cap: int, k: int) -> list[int]:
        """Take ``k`` packs with capacity ``cap``, most recent first."""
        stack = self.stacks[cap]
        taken = stack[len(stack) - k :][::-1]
        del stack[len(stack) - k :]
        self.count[cap] -= k
        return taken

    def new(self, k: int) -> list[int]:
        self.opened += k
        return list(range(self.opened - k, self.opened))

    def fill(self, taken: list[int], cap: int, length: int, q: int, full: int, part: int, ids: list, takes: list):
        """The first ``full`` packs of ``taken`` get ``q`` items, a last one ``part``; file them under their new
        capacity and record (pack ids, items per pack) in ``ids`` / ``takes``."""
        ids.append(np.asarray(taken, dtype=np.int64))
        takes.append(np.asarray([q] * full + ([part] if part else []), dtype=np.int64))
        for items, group in ((q, taken[:full]), (part, taken[full:])):
            new_cap = cap - items * length
            if group and new_cap > 0:  # a full pack never takes anything again
                self.stacks[new_cap].extend(group)
                self.count[new_cap] += len(group)


def first_fit_shuffle(lengths, pack_size: int, seed: int = 0) -> np.ndarray:
    """First fit over the samples in a random order drawn from ``seed``."""
    return _shuffled(lengths, pack_size, seed, _first_fit_in_order)


def _first_fit_in_order(lengths: np.ndarray, order: np.ndarray, pack_size: int) -> np.ndarray:
    """First fit, one item at a time in ``order``: binary max tree in a flat Python list."""
    n = len(lengths)
    bin_ids = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_ids
    size = 1 << max(0, (_max_bins(lengths, pack_size) - 1).bit_length())
    tree = [pack_size] * (2 * size)  # every node starts with a full, unopened pack below it
    out = []
    append = out.append
    for length in lengths[order].tolist():
        i = 1
        while i < size:
            i <<= 1
            if tree[i] < length:
                i += 1
        cap = tree[i] - length
        tree[i] = cap
        append(i - size)
        while i > 1:
            i >>= 1
            left, right = tree[2 * i], tree[2 * i + 1]
            best = left if left > right else right
            if tree[i] == best:
                break
            tree[i] = best
    bin_ids[order] = out
    return bin_ids


def best_fit_shuffle(lengths, pack_size: int, seed: int = 0) -> np.ndarray:
    """Best fit over the samples in a random order drawn from ``seed``."""
    return _shuffled(lengths, pack_size, seed, _best_fit_in_order)


def _best_fit_in_order(lengths: np.ndarray, order: np.ndarray, pack_size: int) -> np.ndarray:
    """Best fit, one item at a time: a two-level bitmap of non-empty capacities (64-bit words + top word)."""
    n = len(lengths)
    bin_ids = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_ids
    stacks: list[list[int]] = [[] for _ in range(pack_size + 1)]
    words = [0] * (pack_size // 64 + 1)  # bit c % 64 of words[c // 64]: some open pack has capacity c
    top = 0  # bit w: words[w] != 0
    next_bin = 0
    out = []
    append = out.append
    for length in lengths[order].tolist():
        w = length >> 6
        m = words[w] >> (length & 63)
        if m:
            cap = length + (m & -m).bit_length() - 1
        else:
            t = top >> (w + 1)
            if t:
                w = w + (t & -t).bit_length()
                m = words[w]
                cap = (w << 6) + (m & -m).bit_length() - 1
            else:
                cap = 0
        if cap:
            stack = stacks[cap]
            b = stack.pop()
            if not stack:
                w = cap >> 6
                words[w] ^= 1 << (cap & 63)
                if not words[w]:
                    top ^= 1 << w
        else:
            b = next_bin
            next_bin += 1
            cap = pack_size
        append(b)
        cap -= length
        if cap:
            stack = stacks[cap]
            stack.append(b)
            if len(stack) == 1:
                w = cap >> 6
                if not words[w]:
                    top |= 1 << w
                words[w] |= 1 << (cap & 63)
    bin_ids[order] = out
    return bin_ids


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
    """Textbook quadratic first fit in the given order (test oracle and benchmark baseline)."""
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
    """Textbook quadratic best fit in the given order (fullest fitting pack, lowest index on ties)."""
    loads: list[int] = []
    out = []
    for length in np.asarray(lengths).tolist():
        best, best_load = -1, -1
        for b, load in enumerate(loads):
            if best_load < load <= pack_size - length:
                best, best_load = b, load
        if best < 0:
            loads.append(0)
            best = len(loads) - 1
        loads[best] += length
        out.append(best)
    return np.asarray(out, dtype=np.int64)
