"""``vlm-pack demo``: a tiny Qwen2-VL trained padded and packed, side by side, on real photos, VQA pairs and chats.

Three identical models (same weights, same micro-batches in the same order) differ only in layout:

* ``padded + mask``: the usual right-padded batch with an attention mask;
* ``padded, causal``: the same batch without the mask. With right padding, causal attention already keeps real
  tokens from seeing the padding, so this is the fastest exact padded baseline (SDPA takes its causal kernel);
* ``packed``: one packed row per micro-batch, varlen attention.

Steps are interleaved (step i of every layout before step i + 1, the order rotating) so load on the machine
hits all layouts alike. The speed-up printed is the median over warm steps of the per-step ratio
(same real tokens, so a time ratio), with its range, next to the ideal ratio: padded slots / packed slots.
The losses must agree step by step: that is the exactness claim; the speed is what packing buys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..testing.data import easy_vqa_examples, photo_examples, text_chat_examples

__all__ = ["DemoResult", "LAYOUTS", "StepRecord", "run_demo"]

LAYOUTS = ("padded + mask", "padded, causal", "packed")


@dataclass(frozen=True)
class StepRecord:
    """One measured step: loss, wall time of forward+backward+optimizer, and the batch's token counts."""

    loss: float
    seconds: float
    real_tokens: int
    padded_slots: int

    @property
    def slots(self) -> int:
        return self.real_tokens + self.padded_slots


@dataclass(frozen=True)
class DemoResult:
    """Per-step records of every layout (``LAYOUTS``), in step order."""

    steps: dict[str, list[StepRecord]]
    samples_per_step: int

    @property
    def padded(self) -> list[StepRecord]:
        return self.steps["padded + mask"]

    @property
    def packed(self) -> list[StepRecord]:
        return self.steps["packed"]

    @property
    def max_loss_gap(self) -> float:
        """Largest |loss difference| between any layout and the masked padded reference, over all steps."""
        return max(abs(a.loss - b.loss) for records in self.steps.values() for a, b in zip(self.padded, records))

    def speedup(self, baseline: str) -> tuple[float, float, float]:
        """Median, min and max over warm steps (step 0 warms caches) of baseline time / packed time."""
        pairs = list(zip(self.steps[baseline], self.packed))
        ratios = [a.seconds / b.seconds for a, b in (pairs[1:] or pairs)]
        return float(np.median(ratios)), min(ratios), max(ratios)

    def ideal(self, baseline: str) -> float:
        """Slots the baseline computes per packed slot: the speed-up if time were proportional to slots."""
        return sum(s.slots for s in self.steps[baseline]) / sum(s.slots for s in self.packed)

    def table(self) -> str:
        def rate(records: list[StepRecord]) -> str:
            timed = records[1:] or records
            return f"{np.median([s.real_tokens / s.seconds for s in timed]):,.0f}"

        def padding(records: list[StepRecord]) -> str:
            return f"{sum(s.padded_slots for s in records) / sum(s.slots for s in records):.1%}"

        rows = [
            ("padding fraction", *(padding(self.steps[name]) for name in LAYOUTS)),
            ("real tokens / s (median warm step)", *(rate(self.steps[name]) for name in LAYOUTS)),
            ("samples per row", "1", "1", f"{self.samples_per_step}"),
        ]
        rows += [(f"loss step {i}", *(f"{self.steps[name][i].loss:.6f}" for name in LAYOUTS))
                 for i in range(len(self.packed))]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':<{width}}" + "".join(f"  {name:>14}" for name in LAYOUTS)]
        lines += [f"{r[0]:<{width}}" + "".join(f"  {v:>14}" for v in r[1:]) for r in rows]
        lines.append("")
        for baseline in ("padded, causal", "padded + mask"):
            median, low, high = self.speedup(baseline)
            lines.append(f"packed vs {baseline + ':':<15} {median:.2f}x median of {max(len(self.packed) - 1, 1)} "
                         f"paired steps (range {low:.2f}-{high:.2f}x); ideal {self.ideal(baseline):.2f}x "
                         "(padded slots / packed slots)")
        lines.append(f"max |loss gap| between layouts over all steps: {self.max_loss_gap:.2e}")
        return "\n".join(lines)


def demo_examples(num: int, seed: int) -> list[dict]:
    """A long-tail mix: photo questions (1-3 images), easy-vqa pairs, and multi-turn text chats."""
    third = max(1, num // 3)
    examples = photo_examples(third, seed=seed) + easy_vqa_examples(third, seed=seed) + text_chat_examples(num - 2 * third, seed=seed)
    random.Random(seed).shuffle(examples)
    return examples


def run_demo(steps: int = 8, micro_batch_size: int = 4, seed: int = 0, lr: float = 1e-3,
             progress: bool = True) -> DemoResult:
    """Train three identical tiny Qwen2-VL models for ``steps`` micro-batches, one per layout, interleaved."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    # Imported here, not at module level: `vlm-pack --help` / `prepare` must not pay for loading transformers.
    from ..core.batch import packing_metadata
    from ..data.collator import VLMPackingCollator
    from ..integrations.hf_model import enable_packing
    from ..testing.tiny_models import offline_qwen2vl_processor, tiny_model
    from ..integrations.torch_loop import train_step

    # The full 151k Qwen vocabulary, as real checkpoints have: the LM head weighs what it weighs in real training.
    processor = offline_qwen2vl_processor(full_vocabulary=True)
    examples = demo_examples(steps * micro_batch_size, seed)
    chunks = [examples[i:i + micro_batch_size] for i in range(0, steps * micro_batch_size, micro_batch_size)]

    runs = {}
    for name in LAYOUTS:
        packed = name == "packed"
        model = tiny_model("qwen2_vl", attn_implementation="sdpa", seed=seed, full_vocabulary=True)
        if packed:
            model = enable_packing(model)
        model.train()
        collator = VLMPackingCollator(processor, max_length=4096, pack_sequences_in_batch=packed,
                                      model_config=model.config)
        batches = [collator(chunk) for chunk in chunks]
        if name == "padded, causal":  # right padding + causal attention: no mask needed for the real tokens
            batches = [{k: v for k, v in batch.items() if k != "attention_mask"} for batch in batches]
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=lr), batches)

    records: dict[str, list[StepRecord]] = {name: [] for name in LAYOUTS}
    for step in tqdm(range(steps), desc="steps (3 layouts each)", unit="step", disable=not progress):
        order = LAYOUTS[step % 3:] + LAYOUTS[: step % 3]
        for name in order:
            model, optimizer, batches = runs[name]
            result = train_step(model, batches[step], optimizer)
            stats = packing_metadata(batches[step])["stats"]
            records[name].append(StepRecord(result.loss, result.seconds, stats.real_tokens, stats.padded_slots))
    return DemoResult(records, micro_batch_size)
