"""Streaming token-budget packs: fill and packs/s of the buffered best fit (``vlm_pack.streaming``) per look-ahead
buffer size, against offline best-fit decreasing (BFD) over the whole dataset at once.

Data: the real ShareGPT token lengths of ``benchmarks/data/sharegpt_lengths.tsv`` (17,671 conversations, Qwen
chat template), in a seeded random stream order; samples longer than the pack are left out (a stream refuses
them, never cuts them). Fill = real tokens / (packs x pack size); the ratio column is stream fill / BFD fill
(= BFD packs / stream packs). Throughput is the packer alone (lengths in, pack ids out), the median of
``--repeats`` interleaved runs; a real stream adds reading, measuring and collating, which dominate.

Run: ``python benchmarks/streaming_packs.py`` (writes ``benchmarks/results/streaming_packs.md``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from vlm_pack.offline.algorithms import best_fit_decreasing
from vlm_pack.streaming import BufferedBestFit

ROOT = Path(__file__).resolve().parent
BUFFERS = (8, 16, 32, 64, 128, 256, 1024)


def sharegpt_lengths(seed: int) -> np.ndarray:
    table = np.loadtxt(ROOT / "data" / "sharegpt_lengths.tsv", dtype=np.int64, ndmin=2)
    lengths = np.repeat(table[:, 0], table[:, 1])
    return np.random.default_rng(seed).permutation(lengths)


def stream_packs(lengths: np.ndarray, pack_size: int, buffer: int) -> tuple[int, float]:
    """(packs, seconds) of the buffered best fit over ``lengths`` in stream order."""
    start = time.perf_counter()
    packs = BufferedBestFit(pack_size, buffer, (0, 0, 0)).count_packs(lengths.tolist())
    return packs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    raw = sharegpt_lengths(args.seed)
    lines = ["# Streaming token-budget packs vs offline best-fit decreasing", "",
             f"`python benchmarks/streaming_packs.py` ({platform.processor() or platform.machine()}, "
             f"{args.repeats} interleaved repeats, median). Data: {raw.size} real ShareGPT token lengths "
             "(benchmarks/data/sharegpt_lengths.tsv) in a seeded random stream order; samples longer than the "
             "pack left out.", ""]
    for pack_size in args.pack_sizes:
        lengths = raw[raw <= pack_size]
        real = int(lengths.sum())
        bfd_packs = int(best_fit_decreasing(lengths, pack_size).max()) + 1
        bfd_fill = real / (bfd_packs * pack_size)
        times: dict[int, list[float]] = {b: [] for b in BUFFERS}
        packs: dict[int, int] = {}
        bfd_times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            best_fit_decreasing(lengths, pack_size)
            bfd_times.append(time.perf_counter() - start)
            for buffer in BUFFERS:  # interleaved: each repeat runs every size once
                packs[buffer], seconds = stream_packs(lengths, pack_size, buffer)
                times[buffer].append(seconds)
        lines += [f"## pack size {pack_size}: {lengths.size} samples, {real / lengths.size:.0f} tokens per sample "
                  f"on average; offline BFD: {bfd_packs} packs, fill {bfd_fill:.4f}, "
                  f"{bfd_packs / statistics.median(bfd_times):,.0f} packs/s (all lengths known up front)", "",
                  "| buffer (samples) | packs | fill | fill / BFD fill | packs/s | samples/s |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for buffer in BUFFERS:
            seconds = statistics.median(times[buffer])
            fill = real / (packs[buffer] * pack_size)
            lines.append(f"| {buffer} | {packs[buffer]} | {fill:.4f} | {fill / bfd_fill:.4f} | "
                         f"{packs[buffer] / seconds:,.0f} | {lengths.size / seconds:,.0f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        (ROOT / "results" / "streaming_packs.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
