"""``vlm-pack demo`` options. Kept apart from :mod:`vlm_pack.cli.demo` (which imports torch) so that ``--help``
answers without loading torch."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a tiny Qwen2-VL padded vs packed on real data and compare",
        description=(
            "Train three identical tiny random Qwen2-VL models on the same micro-batches of shipped photos, VQA "
            "pairs and chats: padded with a mask, padded causal and packed, steps interleaved. Prints the padding "
            "fraction, real tokens/s, the loss of every step (the layouts must agree: the exactness claim) and the "
            "packed speed-up next to the ideal ratio (padded slots / packed slots). CPU, no download."
        ),
    )
    p.add_argument("--steps", type=int, default=8, help="training steps per layout (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the models' weights and the data order")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .demo import run_demo

    print(run_demo(steps=args.steps, micro_batch_size=args.micro_batch_size, seed=args.seed).table())
    return 0
