"""Offline bin-packing speed and efficiency: our four algorithms vs a naive quadratic first fit and TRL's BFD.

Length sets (clipped to the pack size, as ``max_seq_length`` truncation would):

* ``lognormal``: mean ~380 tokens, sigma 1 (an SFT mix like Tulu-3);
* ``chat_mix``: long-tail chat-like mixture: 60% short turns (mean ~120), 30% multi-turn (mean ~800),
  10% Pareto tail from 1500 tokens (many hit the pack size).

Runs, side by side in one process: every algorithm at 10k / 100k / 1M / 10M lengths and pack size 4096; a
pack-size sweep (2048 / 4096 / 8192) at 1M; the quadratic first fit (textbook loop, same order as first fit
decreasing, so identical packs) where its quadratic estimate from the 10k run stays under 60 s; TRL's
``pack_dataset(strategy="bfd")`` when ``trl`` imports (it is not a dependency: ``pip install trl`` to include
it; we feed it a null-valued token column, so only its packing is timed, in one ``map`` batch).
Cells marked "skipped (est. N s)" were not run; N extrapolates the measured smaller size.

    python benchmarks/packing.py            # default run, about 4 minutes on 2 shared CPU cores
    python benchmarks/packing.py --quick    # 10k and 100k at 4096 only, seconds; prints, writes nothing
    python benchmarks/packing.py --full     # also the slow cells (shuffle variants at 10M, TRL at 1M, ...)

Writes ``benchmarks/results/packing_cpu.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlm_pack.offline.algorithms import ALGORITHMS, naive_first_fit, pack_lengths, packing_stats

SHORT = {"first_fit_decreasing": "FFD", "best_fit_decreasing": "BFD", "first_fit_shuffle": "FFS",
         "best_fit_shuffle": "BFS"}
NAIVE_LIMIT_S = 60.0
SLOW_LIMIT_S = 10.0  # default run: skip a cell whose estimate exceeds this (--full lifts it)


def lengths_for(dist: str, n: int, seed: int = 0) -> np.ndarray:
    """Unclipped sample lengths of one synthetic length set."""
    rng = np.random.default_rng(seed)

    def lognormal(mean, sigma, size):
        return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size)

    if dist == "lognormal":
        x = lognormal(380, 1.0, n)
    elif dist == "chat_mix":
        kind = rng.choice(3, size=n, p=[0.6, 0.3, 0.1])
        x = np.where(kind == 0, lognormal(120, 0.9, n),
                     np.where(kind == 1, lognormal(800, 0.6, n), 1500 * (1 + rng.pareto(1.5, n))))
    else:
        raise ValueError(dist)
    return np.maximum(np.round(x), 1).astype(np.int64)


@dataclass
class Cell:
    seconds: float | None  # None: skipped
    efficiency: float | None = None
    packs: int | None = None
    estimate: float | None = None

    def text(self) -> str:
        if self.seconds is None:
            return f"skipped (est. {self.estimate:.0f} s)" if self.estimate is not None else "n/a"
        return f"{_fmt_s(self.seconds)} / {self.efficiency:.3f}%"


def _estimate(before: Cell | None, factor: float | None) -> float | None:
    """Extrapolated seconds from the previous (smaller) size, measured or itself estimated."""
    if before is None or factor is None:
        return None
    base = before.seconds if before.seconds is not None else before.estimate
    return None if base is None else base * factor


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _timed(fn, lengths, pack_size, repeat) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    loads = np.bincount(out, weights=lengths)
    assert len(out) == len(lengths) and loads.max() <= pack_size, "invalid packing"
    return best, out


def run_ours(lengths, pack_size, algorithm) -> Cell:
    repeat = 3 if len(lengths) <= 100_000 else 1
    seconds, bin_ids = _timed(lambda: pack_lengths(lengths, pack_size, algorithm, seed=0), lengths, pack_size, repeat)
    stats = packing_stats(lengths, bin_ids, pack_size)
    return Cell(seconds, stats.packing_efficiency, stats.num_packs)


def run_naive(lengths, pack_size) -> Cell:
    order = np.argsort(-lengths, kind="stable")
    seconds, ids = _timed(lambda: naive_first_fit(lengths[order], pack_size), lengths[order], pack_size, 1)
    stats = packing_stats(lengths[order], ids, pack_size)
    return Cell(seconds, stats.packing_efficiency, stats.num_packs)


def trl_pack_fn():
    """TRL's public pack_dataset, or None when trl is not importable."""
    try:
        from trl import pack_dataset
    except ImportError:
        return None
    return pack_dataset


def run_trl(pack_dataset, lengths, pack_size) -> Cell:
    import pyarrow as pa
    from datasets import Dataset

    offsets = np.concatenate(([0], np.cumsum(lengths)))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.nulls(int(offsets[-1])))  # no token memory
    dataset = Dataset(pa.table({"input_ids": column}))
    start = time.perf_counter()
    packed = pack_dataset(dataset, pack_size, strategy="bfd",
                          map_kwargs={"batch_size": len(lengths), "keep_in_memory": True})
    seconds = time.perf_counter() - start
    return Cell(seconds, 100.0 * lengths.sum() / (len(packed) * pack_size), len(packed))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k at 4096 only; writes nothing by default")
    parser.add_argument("--full", action="store_true", help="run the slow cells too (minutes)")
    parser.add_argument("--output", default=None, help="markdown output (default benchmarks/results/packing_cpu.md)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000, 10_000_000]
    sweep_n = None if args.quick else 1_000_000
    limit = float("inf") if args.full else SLOW_LIMIT_S
    pack_dataset = trl_pack_fn()
    trl_version = "not installed"
    if pack_dataset is not None:
        import trl

        trl_version = trl.__version__

    lines = [
        "# Offline packing algorithms: speed and efficiency",
        "",
        f"Machine: CPU, 2 cores (shared with other jobs), {platform.processor() or platform.machine()}; "
        f"Python {platform.python_version()}, numpy {np.__version__}; TRL {trl_version}. "
        f"Generated by `python benchmarks/packing.py{' --full' if args.full else ''}`.",
        "",
        "Cells: wall time / packing efficiency (real tokens / pack slots). FFD/BFD = first/best fit decreasing, "
        "FFS/BFS = first/best fit on a seeded shuffle. The naive first fit is the textbook quadratic loop over "
        "open packs in FFD order (same packs as our FFD); TRL = `trl.pack_dataset(strategy=\"bfd\")` in one batch.",
    ]
    data = {dist: lengths_for(dist, max(sizes)) for dist in ("lognormal", "chat_mix")}
    summary = []
    for dist, all_lengths in data.items():
        lines += ["", f"## {dist}, pack size 4096", ""]
        header = ["n", "mean len", *[SHORT[a] for a in ALGORITHMS], "naive FF", "TRL bfd", "naive / FFD", "TRL / BFD"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        prev: dict[str, Cell] = {}
        for n in sizes:
            lengths = np.minimum(all_lengths[:n], 4096)
            grow = None if not prev else n / prev["n"]
            cells = {}
            for algorithm in ALGORITHMS:  # n log n: estimate linearly (slightly optimistic)
                estimate = _estimate(prev.get(algorithm), grow)
                cells[algorithm] = (Cell(None, estimate=estimate) if estimate is not None and estimate > limit
                                    else run_ours(lengths, 4096, algorithm))
            estimate = _estimate(prev.get("naive"), grow and grow**2)  # quadratic
            if estimate is not None and estimate > (5.0 if args.quick else NAIVE_LIMIT_S):
                cells["naive"] = Cell(None, estimate=estimate)
            else:
                cells["naive"] = run_naive(lengths, 4096)
                assert cells["naive"].packs == cells["first_fit_decreasing"].packs, "naive FF disagrees with FFD"
            estimate = _estimate(prev.get("trl"), grow and grow * 1.2)  # measured: a bit worse than linear
            if pack_dataset is None:
                cells["trl"] = Cell(None)
            elif estimate is not None and estimate > limit:
                cells["trl"] = Cell(None, estimate=estimate)
            else:
                cells["trl"] = run_trl(pack_dataset, lengths, 4096)
            ratios = []
            for slow, fast in (("naive", "first_fit_decreasing"), ("trl", "best_fit_decreasing")):
                s, f = cells[slow], cells[fast]
                s_time = s.seconds if s.seconds is not None else s.estimate
                if s_time is None or f.seconds is None:
                    ratios.append("n/a")
                else:
                    ratios.append(f"{'~' if s.seconds is None else ''}{s_time / f.seconds:,.0f}x")
            row = [f"{n:,}", f"{lengths.mean():.0f}", *[cells[a].text() for a in ALGORITHMS],
                   cells["naive"].text(), cells["trl"].text(), *ratios]
            lines.append("| " + " | ".join(row) + " |")
            print(f"[{dist} n={n:,}] " + "  ".join(f"{k}: {c.text()}" for k, c in cells.items()), flush=True)
            prev = {**cells, "n": n}
            if n == 1_000_000:
                summary.append((dist, cells))
    if sweep_n:
        lines += ["", f"## Pack-size sweep at {sweep_n:,} lengths", "",
                  "| set | pack size | " + " | ".join(SHORT[a] for a in ALGORITHMS) + " | n (samples/pack) |",
                  "|" + "---|" * (len(ALGORITHMS) + 3)]
        for dist, all_lengths in data.items():
            for pack_size in (2048, 4096, 8192):
                lengths = np.minimum(all_lengths[:sweep_n], pack_size)
                cells = {a: run_ours(lengths, pack_size, a) for a in ALGORITHMS}
                factor = sweep_n / cells["first_fit_decreasing"].packs
                lines.append(f"| {dist} | {pack_size} | " + " | ".join(cells[a].text() for a in ALGORITHMS)
                             + f" | {factor:.2f} |")
                print(f"[sweep {dist} {pack_size}] " + "  ".join(f"{SHORT[a]}: {cells[a].text()}" for a in ALGORITHMS),
                      flush=True)
    if summary:
        lines += ["", "## Targets (issue 5)", ""]
        for dist, cells in summary:
            best = max(ALGORITHMS, key=lambda a: cells[a].efficiency)
            lines.append(f"- {dist}, 1M lengths at 4096 (targets: <= 2 s; >= 99% efficiency on lognormal): "
                         + ", ".join(f"{SHORT[a]} {_fmt_s(cells[a].seconds)}" for a in ALGORITHMS)
                         + f"; best efficiency {cells[best].efficiency:.3f}% ({SHORT[best]})")
    lines += ["", f"Total benchmark wall time: {time.perf_counter() - started:.0f} s."]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    output = args.output or (None if args.quick else str(Path(__file__).parent / "results" / "packing_cpu.md"))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
