"""Opening offline packed data stays O(1) in its size; `vlm-pack verify` (the full check) is O(data).

Writes synthetic splits of 10k, 100k and 1M samples (lengths 1..64, pack size 512, first-fit decreasing) with
metadata and checksums, then times, interleaved round-robin over the sizes: ``open_packed`` (header, size and
metadata checks, memory maps), ``PackedSFTDataset(...)`` (adds its own pack-length check) and reading pack 0.
Prints medians with min-max and writes ``benchmarks/results/offline_open_cpu.md``; ``--verify`` also times verify.

    python benchmarks/offline_open.py [--repeats 15] [--verify]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vlm_pack.offline.algorithms import group_by_pack, pack_lengths, packing_stats
from vlm_pack.offline.storage import (
    PackedArrays, build_index, file_checksums, metadata_path, open_packed, split_path, write_metadata, write_packed,
)

SIZES = (10_000, 100_000, 1_000_000)
PACK = 512


def write_split(directory: Path, n: int) -> Path:
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 65, n)
    bins = pack_lengths(lengths, PACK, "first_fit_decreasing")
    order, pack_offsets = group_by_pack(bins)
    offsets = np.concatenate(([0], np.cumsum(lengths[order]))).astype(np.int64)
    arrays = PackedArrays(index=build_index(np.diff(pack_offsets), offsets),
                          tokens=rng.integers(0, 150_000, offsets[-1], dtype=np.int32),
                          loss_mask=(rng.random(offsets[-1]) < 0.5).astype(np.uint8),
                          seq_offsets=offsets, source_index=order.astype(np.int64))
    index = write_packed(split_path(directory, "training", PACK), arrays)
    stats = packing_stats(lengths, bins, PACK)
    write_metadata(metadata_path(directory, PACK), [{
        "split": "training", "format": "vlm_pack.offline.v1", "pack_size": PACK, "num_packs": stats.num_packs,
        "num_samples": n, "num_tokens": int(offsets[-1]), "max_samples_per_bin": stats.max_samples_per_bin,
        "packing_factor": round(stats.packing_factor, 4), "files": file_checksums(index)}])
    return index


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--verify", action="store_true", help="also time `verify_packed` (O(data), slow at 1M)")
    args = parser.parse_args()
    from vlm_pack.offline.dataset import PackedSFTDataset
    from vlm_pack.offline.verify import verify_packed

    with tempfile.TemporaryDirectory() as tmp:
        indexes = {n: write_split(Path(tmp) / str(n), n) for n in SIZES}
        results = {n: {"open_packed": [], "PackedSFTDataset": [], "read pack 0": [], "verify": []} for n in SIZES}
        for _ in range(args.repeats):  # interleaved: every size in every round
            for n, index in indexes.items():
                results[n]["open_packed"].append(timed(lambda: open_packed(index)))
                results[n]["PackedSFTDataset"].append(timed(lambda: PackedSFTDataset(index, PACK)))
                data = open_packed(index)
                results[n]["read pack 0"].append(timed(lambda: data.pack(0)))
        if args.verify:
            for n, index in indexes.items():
                results[n]["verify"].append(timed(lambda: verify_packed(index.parent)))
        sizes_mb = {n: sum(p.stat().st_size for p in index.parent.iterdir()) / 2**20 for n, index in indexes.items()}
    columns = ["open_packed", "PackedSFTDataset", "read pack 0"] + (["verify"] if args.verify else [])
    lines = [
        f"Open time of an offline packed split vs its size (pack size {PACK}, lengths 1..64; ms, median "
        f"[min-max] of {args.repeats} interleaved rounds; CPU, load average {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d')}).",
        "",
        "| samples | data MiB | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for n in SIZES:
        cells = []
        for c in columns:
            v = results[n][c]
            cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "-")
        lines.append(f"| {n:,} | {sizes_mb[n]:.0f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(__file__).resolve().parent / "results" / "offline_open_cpu.md"
    out.write_text(table + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
