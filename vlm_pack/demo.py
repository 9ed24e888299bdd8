"""``vlm-pack demo``: a tiny Qwen2-VL trained padded, then packed, on real photos, VQA pairs and text chats.

Both runs start from the same weights and see the same micro-batches in the same order; only the layout
differs. The printed table is measured in this run: padding fraction, real tokens per second, the loss of
every step (equal for both layouts, which is the point) and how many samples share one packed row.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import easy_vqa_examples, photo_examples, text_chat_examples

__all__ = ["DemoResult", "StepRecord", "run_demo", "add_parser"]


@dataclass(frozen=True)
class StepRecord:
    """One measured step: loss, wall time of forward+backward+optimizer, and the batch's token counts."""

    loss: float
    seconds: float
    real_tokens: int
    padded_slots: int


@dataclass(frozen=True)
class DemoResult:
    """Per-step results of both runs, in the same order."""

    padded: list[StepRecord]
    packed: list[StepRecord]
    samples_per_step: int

    @staticmethod
    def _rate(steps: list[StepRecord]) -> float:
        """Real tokens per second, leaving out the first step (one-time warm-up) when there are more."""
        timed = steps[1:] or steps
        return sum(s.real_tokens for s in timed) / sum(s.seconds for s in timed)

    @staticmethod
    def _padding(steps: list[StepRecord]) -> float:
        real = sum(s.real_tokens for s in steps)
        pad = sum(s.padded_slots for s in steps)
        return pad / (real + pad)

    @property
    def max_loss_gap(self) -> float:
        return max(abs(a.loss - b.loss) for a, b in zip(self.padded, self.packed))

    def table(self) -> str:
        rows = [
            ("padding fraction", f"{self._padding(self.padded):.1%}", f"{self._padding(self.packed):.1%}"),
            ("real tokens / s (fwd+bwd+step, warm)", f"{self._rate(self.padded):,.0f}", f"{self._rate(self.packed):,.0f}"),
            ("samples per row", "1", f"{self.samples_per_step}"),
        ]
        rows += [(f"loss step {i}", f"{a.loss:.6f}", f"{b.loss:.6f}") for i, (a, b) in enumerate(zip(self.padded, self.packed))]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':<{width}}  {'padded':>12}  {'packed':>12}"]
        lines += [f"{name:<{width}}  {a:>12}  {b:>12}" for name, a, b in rows]
        speedup = self._rate(self.packed) / self._rate(self.padded)
        lines.append(f"\npacked / padded real tokens/s: {speedup:.2f}x   max |loss gap| over steps: {self.max_loss_gap:.2e}")
        return "\n".join(lines)


def demo_examples(num: int, seed: int) -> list[dict]:
    """A long-tail mix: photo questions (1-3 images), easy-vqa pairs, and multi-turn text chats."""
    third = max(1, num // 3)
    examples = photo_examples(third, seed=seed) + easy_vqa_examples(third, seed=seed) + text_chat_examples(num - 2 * third, seed=seed)
    random.Random(seed).shuffle(examples)
    return examples


def _run(model, batches, desc: str, lr: float) -> list[StepRecord]:
    from .batch import packing_metadata
    from .train import train_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    records = []
    for batch in tqdm(batches, desc=desc, unit="step"):
        step = train_step(model, batch, optimizer)
        stats = packing_metadata(batch)["stats"]
        records.append(StepRecord(step.loss, step.seconds, stats.real_tokens, stats.padded_slots))
    return records


def run_demo(steps: int = 6, micro_batch_size: int = 4, seed: int = 0, lr: float = 1e-3) -> DemoResult:
    """Train two identical tiny Qwen2-VL models for ``steps`` micro-batches: padded, then packed."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    # Imported here, not at module level: `vlm-pack --help` / `prepare` must not pay for loading transformers.
    from .collator import VLMPackingCollator
    from .hf import ATTN_IMPLEMENTATION, register_attention
    from .tiny_models import offline_qwen2vl_processor, tiny_model

    register_attention()
    processor = offline_qwen2vl_processor()
    examples = demo_examples(steps * micro_batch_size, seed)
    batches = [examples[i:i + micro_batch_size] for i in range(0, steps * micro_batch_size, micro_batch_size)]

    results = {}
    for mode in ("padded", "packed"):
        implementation = ATTN_IMPLEMENTATION if mode == "packed" else "sdpa"
        model = tiny_model("qwen2_vl", attn_implementation=implementation, seed=seed)
        collator = VLMPackingCollator(processor, max_length=4096, pack_sequences_in_batch=mode == "packed",
                                      model_config=model.config)
        collated = [collator(chunk) for chunk in batches]
        results[mode] = _run(model, collated, mode, lr)
    return DemoResult(results["padded"], results["packed"], micro_batch_size)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="train a tiny Qwen2-VL padded vs packed on real data and compare")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = run_demo(steps=args.steps, micro_batch_size=args.micro_batch_size, seed=args.seed)
    print(result.table())
    return 0
