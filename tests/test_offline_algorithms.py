"""Bin packing on length arrays: invariants (hypothesis), exactness against the quadratic oracles, known cases."""

import itertools
import math
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack.offline import algorithms
from vlm_pack.offline.algorithms import (
    ALGORITHMS,
    best_fit_decreasing,
    first_fit_decreasing,
    group_by_pack,
    naive_best_fit,
    naive_first_fit,
    pack_lengths,
    packing_stats,
)


@st.composite
def lengths_and_size(draw):
    pack_size = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, pack_size), max_size=150))
    return np.asarray(lengths, dtype=np.int64), pack_size


_M64 = 2**64 - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def reference_shuffle_order(n: int, seed: int, bucket: int) -> np.ndarray:
    """The documented shuffle written plainly in Python integers: splitmix64 seeded with mix(seed); every sample
    draws a bucket from the top bits; each bucket's members (dataset order) are Fisher-Yates shuffled with
    Lemire's unbiased bounded draws; buckets concatenated in order."""
    key_bits = min(16, max(0, math.ceil(math.log2(max(n / bucket, 1)))))
    state = _mix(seed)

    def draw() -> int:
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) & _M64
        return _mix(state)

    keys = [draw() >> (64 - key_bits) if key_bits else 0 for _ in range(n)]
    order = []
    for b in range(1 << key_bits):
        members = [i for i in range(n) if keys[i] == b]
        for j in range(len(members) - 1, 0, -1):
            product = (draw() >> 32) * (j + 1)
            if product & 0xFFFFFFFF < j + 1:
                while product & 0xFFFFFFFF < (2**32 - (j + 1)) % (j + 1):
                    product = (draw() >> 32) * (j + 1)
            k = product >> 32
            members[j], members[k] = members[k], members[j]
        order += members
    return np.asarray(order, dtype=np.int64)


def _processing_order(algorithm: str, lengths: np.ndarray, seed: int) -> np.ndarray:
    """The order the algorithm visits samples in (what the oracle must replay)."""
    if algorithm.endswith("_shuffle"):
        return reference_shuffle_order(len(lengths), seed, algorithms._SHUFFLE_BUCKET)
    return np.argsort(-lengths, kind="stable")


def _oracle(algorithm: str, lengths: np.ndarray, pack_size: int, seed: int) -> np.ndarray:
    order = _processing_order(algorithm, lengths, seed)
    naive = naive_first_fit if algorithm.startswith("first_fit") else naive_best_fit
    out = np.empty(len(lengths), dtype=np.int64)
    out[order] = naive(lengths[order], pack_size)
    return out


def _check_valid(lengths: np.ndarray, bin_ids: np.ndarray, pack_size: int) -> None:
    """Every sample in exactly one pack, packs numbered 0..P-1 with none empty, none over capacity."""
    assert bin_ids.shape == lengths.shape and bin_ids.dtype == np.int64
    if len(lengths):
        assert bin_ids.min() == 0 and np.all(np.bincount(bin_ids) > 0)
        assert np.bincount(bin_ids, weights=lengths).max() <= pack_size


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=lengths_and_size(), seed=st.integers(0, 2**16))
def test_valid_and_equal_to_the_quadratic_reference(algorithm, case, seed):
    lengths, pack_size = case
    bin_ids = pack_lengths(lengths, pack_size, algorithm, seed)
    _check_valid(lengths, bin_ids, pack_size)
    # the textbook loop of the same rule in the same order: the very same packs (both rules are deterministic,
    # best fit with its documented tie rule)
    assert np.array_equal(bin_ids, _oracle(algorithm, lengths, pack_size, seed))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deep_trees_equal_the_reference(algorithm):
    """A four-level first-fit tree, long best-fit stacks, pack sizes past 16 bits: still exactly the reference."""
    rng = np.random.default_rng(3)
    for pack_size, n in ((50, 1200), (4096, 400), (2**16 + 3, 300)):  # int16 and int32 rooms
        lengths = rng.integers(1, pack_size + 1, size=n)
        bin_ids = pack_lengths(lengths, pack_size, algorithm, seed=7)
        _check_valid(lengths, bin_ids, pack_size)
        assert np.array_equal(bin_ids, _oracle(algorithm, lengths, pack_size, 7))


def test_best_fit_tie_rule():
    # pack size 10: both 6s leave room 4; best fit puts the 2 into the pack filled most recently, first fit
    # into the first one
    assert best_fit_decreasing([6, 6, 2], 10).tolist() == [0, 1, 1]
    assert naive_best_fit([6, 6, 2], 10).tolist() == [0, 1, 1]
    assert first_fit_decreasing([6, 6, 2], 10).tolist() == [0, 1, 0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pack_bound_is_enforced(algorithm, monkeypatch):
    """The compiled loops refuse to run past their arrays: with the proven bound faked too low, a clear error."""
    monkeypatch.setattr(algorithms, "_max_bins", lambda lengths, pack_size: 1)
    with pytest.raises(RuntimeError, match="more than the proven bound of 1 packs"):
        pack_lengths([3, 3], 4, algorithm)


def test_known_first_fit_decreasing():
    # sorted 5,4,3,2,2,1 into 6: [5,1] [4,2] [3,2]
    bin_ids = first_fit_decreasing([5, 4, 3, 2, 2, 1], 6)
    assert bin_ids.tolist() == [0, 1, 2, 1, 2, 0]
    stats = packing_stats([5, 4, 3, 2, 2, 1], bin_ids, 6)
    assert (stats.num_packs, stats.max_samples_per_bin, stats.min_packed_seqlen) == (3, 2, 5)
    assert stats.packing_factor == 2.0 and stats.packing_efficiency == pytest.approx(100 * 17 / 18)


def test_first_fit_and_best_fit_differ_where_they_should():
    # pack size 7: after 5 -> pack 0 (room 2) and 3, 3 -> pack 1 (room 1), the 1 goes to the FIRST pack with
    # room under first fit but to the FULLEST pack under best fit
    assert first_fit_decreasing([5, 3, 3, 1], 7).tolist() == [0, 1, 1, 0]
    assert best_fit_decreasing([5, 3, 3, 1], 7).tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("algorithm", ["first_fit_shuffle", "best_fit_shuffle"])
@pytest.mark.parametrize("bucket", [1, 7, 64])
def test_bucketed_shuffle_equals_the_reference(algorithm, bucket, monkeypatch):
    """Many buckets (small bucket targets stand in for 10M samples): the packs of the reference order."""
    monkeypatch.setattr(algorithms, "_SHUFFLE_BUCKET", bucket)
    lengths = np.random.default_rng(4).integers(1, 50, size=700)
    for seed in (0, 5, 2**64 - 1):
        bin_ids = pack_lengths(lengths, 64, algorithm, seed)
        _check_valid(lengths, bin_ids, 64)
        assert np.array_equal(bin_ids, _oracle(algorithm, lengths, 64, seed))


@pytest.mark.parametrize(("n", "bucket"), [(4, 1), (4, 4096), (5, 2)])
def test_shuffle_is_uniform(n, bucket, monkeypatch):
    """Every one of the n! orders equally likely over 200 * n! seeds (chi-square, p < 1e-6 fails), one bucket or
    several (Rao-Sandelius); the classic naive shuffle must fail the same check."""
    monkeypatch.setattr(algorithms, "_SHUFFLE_BUCKET", bucket)
    cells = math.factorial(n)

    def statistic() -> float:
        seen = {}
        for seed in range(200 * cells):
            order = tuple(algorithms._shuffle(np.arange(n), seed)[0])
            seen[order] = seen.get(order, 0) + 1
        counts = np.array([seen.get(p, 0) for p in itertools.permutations(range(n))])
        return float(((counts - 200) ** 2 / 200).sum())

    critical = {23: 62.5, 119: 200.0}[cells - 1]  # chi-square quantile at 1 - 1e-6 for n! - 1 degrees of freedom
    assert statistic() < critical

    def naive_shuffle(values, seed):  # the classic bug: every position swaps with ANY position (n^n paths)
        rng, out = random.Random(seed), list(values)
        for j in range(n):
            k = rng.randrange(n)
            out[j], out[k] = out[k], out[j]
        return (np.asarray(out),)

    monkeypatch.setattr(algorithms, "_shuffle", naive_shuffle)
    assert statistic() > critical


def test_shuffle_seed_must_be_a_64_bit_unsigned_integer():
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            pack_lengths([1, 2], 4, "first_fit_shuffle", seed)


def test_shuffle_variants_depend_on_seed_only():
    lengths = np.random.default_rng(0).integers(1, 100, size=500)
    for algorithm in ("first_fit_shuffle", "best_fit_shuffle"):
        runs = {tuple(pack_lengths(lengths, 128, algorithm, seed)) for seed in (1, 1, 2)}
        assert len(runs) == 2


def test_group_by_pack():
    order, offsets = group_by_pack(np.array([1, 0, 1, 2, 0]))
    assert order.tolist() == [1, 4, 0, 2, 3] and offsets.tolist() == [0, 2, 4, 5]


@pytest.mark.parametrize(
    ("lengths", "pack_size", "match"),
    [
        ([3, 4, 9, 2], 8, r"sample 2 has 9 tokens, more than the pack size 8.*max_seq_length"),
        ([3, 0, 2], 8, r"sample 1 has length 0"),
        ([[1, 2]], 8, r"1-D"),
        ([1.5, 2.0], 8, r"integers"),
        ([1, 2], 0, r"pack_size must be >= 1"),
        ([1, 2], np.int64(0), r"pack_size must be >= 1"),
        ([1, 2], True, r"pack_size must be an integer number of tokens, got True \(bool\)"),
        ([1, 2], np.bool_(True), r"pack_size must be an integer number of tokens.*bool"),
        ([1, 2], 8.0, r"pack_size must be an integer number of tokens, got 8.0 \(float\).*pack_size=4096"),
        ([1, 2], np.float32(8), r"pack_size must be an integer number of tokens.*float32"),
        ([True, False], 8, r"integers"),
    ],
)
def test_bad_lengths(lengths, pack_size, match):
    for algorithm in ALGORITHMS:
        with pytest.raises(ValueError, match=match):
            pack_lengths(lengths, pack_size, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("pack_size", [np.int64(8), np.int32(8), np.uint16(8), 8])
def test_numpy_integer_pack_size(algorithm, pack_size):
    """A pack size read from a numpy array or a metadata file packs exactly like the Python int."""
    lengths = np.array([5, 3, 3, 1, 7, 2])
    bin_ids = pack_lengths(lengths, pack_size, algorithm, seed=1)
    assert np.array_equal(bin_ids, pack_lengths(lengths, 8, algorithm, seed=1))
    assert packing_stats(lengths, bin_ids, pack_size).pack_size == 8


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="unknown packing algorithm 'next_fit'.*first_fit_decreasing"):
        pack_lengths([1, 2], 4, "next_fit")


def test_empty_input():
    for algorithm in ALGORITHMS:
        assert pack_lengths(np.zeros(0, dtype=np.int64), 16, algorithm).shape == (0,)


def test_large_input_is_fast_and_tight():
    """A guard against quadratic regressions; the real numbers live in benchmarks/packing.py."""
    rng = np.random.default_rng(0)
    sigma = 1.0
    lengths = np.clip(rng.lognormal(np.log(380) - sigma**2 / 2, sigma, 300_000).round(), 1, 4096).astype(np.int64)
    pack_lengths(lengths[:10], 4096, "first_fit_decreasing")  # compile (or load) the loops outside the timing
    pack_lengths(lengths[:10], 4096, "best_fit_decreasing")
    for algorithm in ALGORITHMS:
        start = time.perf_counter()
        bin_ids = pack_lengths(lengths, 4096, algorithm)
        elapsed = time.perf_counter() - start
        assert packing_stats(lengths, bin_ids, 4096).packing_efficiency >= 99.0
        assert elapsed < 10.0, f"{algorithm} took {elapsed:.1f}s for 300k lengths"
