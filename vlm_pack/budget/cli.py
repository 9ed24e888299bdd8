"""``vlm-pack plan-vlm``: measure a chat JSONL exactly and write a token-budget pack plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..offline.algorithms import ALGORITHMS
from ..offline.records import read_jsonl

__all__ = ["add_parser", "read_chat_jsonl", "run"]


def read_chat_jsonl(path: str | Path) -> list[dict]:
    """Chat examples from a JSONL file (read by the offline reader: errors name the file line and the fix);
    relative image paths are resolved against the file's folder."""
    records = read_jsonl(path)
    for i, row in enumerate(records.rows):
        if not isinstance(row, dict):
            raise ValueError(f"{records.where(i)}: expected an object with 'messages'; got {type(row).__name__}")
    root = Path(path).parent
    return [_resolve_paths(row, root) for row in records.rows]


def _resolve_paths(value: Any, root: Path) -> Any:
    """Relative ``path`` / ``image`` strings of image parts and ``images`` entries -> absolute paths."""
    if isinstance(value, dict):
        out = {key: _resolve_paths(item, root) for key, item in value.items()}
        if out.get("type") == "image":
            for key in ("image", "path"):
                if isinstance(out.get(key), str) and not Path(out[key]).is_absolute():
                    out[key] = str(root / out[key])
        if isinstance(out.get("images"), list):
            out["images"] = [str(root / p) if isinstance(p, str) and not Path(p).is_absolute() else p
                             for p in out["images"]]
        return out
    if isinstance(value, list):
        return [_resolve_paths(item, root) for item in value]
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan-vlm",
        help="plan fixed-size token-budget packs for a VLM chat dataset (exact lengths, image headers only)",
        description=(
            "Measure every chat example of a JSONL file exactly as VLMPackingCollator will encode it (text through "
            "the chat template and tokenizer, each image's token count from its header size through the "
            "processor's own resize rule), bin-pack into packs of --pack-size tokens and write the plan folder "
            "(plan.json + int64 .npy arrays). Train with vlm_pack.budget.TokenBudgetPackDataset."
        ),
    )
    p.add_argument("--input", required=True, help="chat JSONL ({'messages': [...]} per line; image paths relative "
                                                   "to the file)")
    p.add_argument("--processor", required=True,
                   help="local processor folder (AutoProcessor.from_pretrained); docs/token_budget_packs.md "
                        "saves a tiny offline one to try")
    p.add_argument("--model-config", default=None, help="local model folder with config.json (default: --processor)")
    p.add_argument("--output", required=True, help="plan folder to write (replaced atomically)")
    p.add_argument("--pack-size", type=int, required=True, help="tokens per pack")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="best_fit_decreasing",
                   help="bin-packing algorithm (default best_fit_decreasing: the fastest, same packs as first fit "
                        "decreasing)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="data-parallel ranks per step: packs are ordered so the ranks of a step get similar "
                        "image-token loads (a warning when there are fewer packs than ranks)")
    p.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel size: samples padded to a multiple of 2 x this (zigzag split), as the "
                        "collator pads them")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel size: with --sequence-parallel, samples padded to a multiple of context x "
                        "tensor-parallel size")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism (see --tensor-parallel-size)")
    p.add_argument("--on-overlong", choices=("error", "drop"), default="error",
                   help="a sample longer than --pack-size: error (default, names the sample) or drop it (counted)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle algorithms and of the order of the rank-balanced pack blocks")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoProcessor

    from ..data.collator import VLMPackingCollator
    from .lengths import measure_lengths
    from .plan import plan_token_budget_packs

    for name in ("processor", "model_config"):
        folder = getattr(args, name) or args.processor
        if not Path(folder).is_dir():
            raise ValueError(f"--{name.replace('_', '-')} {folder}: not a local folder (give the checkpoint directory)")
    processor = AutoProcessor.from_pretrained(args.processor, local_files_only=True)
    config = AutoConfig.from_pretrained(args.model_config or args.processor, local_files_only=True)
    collator = VLMPackingCollator(processor, max_length=args.pack_size, model_config=config,
                                  context_parallel_size=args.context_parallel_size,
                                  tensor_parallel_size=args.tensor_parallel_size,
                                  sequence_parallel=args.sequence_parallel)
    examples = read_chat_jsonl(args.input)
    lengths = measure_lengths(examples, collator, progress=not args.no_progress)
    plan = plan_token_budget_packs(lengths, args.pack_size, pad_to_multiple_of=collator.pad_to_multiple_of,
                                   algorithm=args.algorithm, data_parallel_size=args.data_parallel_size,
                                   seed=args.seed, on_overlong=args.on_overlong)
    plan.save(args.output)
    meta = plan.metadata()
    print(f"{meta['num_samples']} samples -> {meta['num_packs']} packs of {meta['pack_size']} tokens "
          f"(efficiency {meta['packing_efficiency']:.2%}, n = {meta['packing_factor']} samples per pack, "
          f"at most {meta['max_samples_per_pack']}; {meta['num_dropped']} dropped) -> {args.output}")
    if meta["num_packs"] < args.data_parallel_size:
        print(f"warning: {meta['num_packs']} packs for {args.data_parallel_size} data-parallel ranks: every rank "
              "needs a pack per step, so a sampler would repeat packs or leave ranks idle; use a smaller "
              "--pack-size, more data or fewer ranks", file=sys.stderr)
    return 0
