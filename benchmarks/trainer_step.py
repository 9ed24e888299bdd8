"""A Hugging Face ``Trainer`` step, packed vs padded: real tokens per second on the same micro-batches.

Both sides are what a user gets from the recipe of docs/trainer_and_trl.md with ``transformers.Trainer``:

* packed: ``enable_packing(model)`` + ``VLMPackingCollator`` (one row, ``cu_seq_lens_*``, no attention mask);
* padded: the stock ``sdpa`` model + the same collator with ``pack_sequences_in_batch=False`` (right-padded
  ``[B, S]`` batch with an attention mask), i.e. the usual padded VLM fine-tuning batch.

Each round draws one micro-batch of chat examples (long-tail mix: photos of several sizes, easy-vqa, multi-turn
text chats), collates it both ways, and times ``Trainer.training_step`` (forward, Trainer's loss with
``num_items_in_batch``, backward) plus the optimizer step for each, in alternating order. A round gives one paired
ratio packed / padded of real tokens per second; the table shows the median with its 10th-90th percentile
spread. Collate time is reported apart (with DataLoader workers it overlaps the step). One intra-op thread.
Run: ``python benchmarks/trainer_step.py [--rounds 12] [--micro-batch 8]``; writes
``benchmarks/results/trainer_step_cpu.md``.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Trainer, TrainingArguments

from vlm_pack import VLMPackingCollator, enable_packing
from vlm_pack.core.batch import packing_metadata
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_model

RESULTS = Path(__file__).resolve().parent / "results"


def micro_batches(rounds: int, size: int, seed: int) -> list[list[dict]]:
    third = max(1, size // 3)
    batches = []
    for r in range(rounds):
        examples = (photo_examples(third, seed=seed + r) + easy_vqa_examples(third, seed=seed + r)
                    + text_chat_examples(size - 2 * third, seed=seed + r))
        np.random.default_rng(seed + r).shuffle(examples)
        batches.append(examples)
    return batches


def make_trainer(model, collator, out: str) -> Trainer:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, optim="sgd", learning_rate=1e-3,
                             max_grad_norm=0.0, use_cpu=True, report_to="none", save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, data_collator=collator)
    trainer.create_optimizer()
    return trainer


def timed_step(trainer: Trainer, batch: dict) -> float:
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
    start = time.perf_counter()
    trainer.training_step(trainer.model, dict(batch), num_items)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(rounds: int, size: int, seed: int) -> dict:
    torch.set_num_threads(1)
    processor = offline_qwen2vl_processor(full_vocabulary=True)
    packed_model = enable_packing(tiny_model("qwen2_vl", seed=seed, full_vocabulary=True))
    padded_model = tiny_model("qwen2_vl", seed=seed, full_vocabulary=True)
    collators = {
        "packed": VLMPackingCollator(processor, max_length=2048, model_config=packed_model.config),
        "padded": VLMPackingCollator(processor, max_length=2048, model_config=padded_model.config,
                                     pack_sequences_in_batch=False),
    }
    out = tempfile.mkdtemp()
    trainers = {"packed": make_trainer(packed_model, collators["packed"], out),
                "padded": make_trainer(padded_model, collators["padded"], out)}
    rows = {mode: {"step_s": [], "collate_s": [], "real": [], "slots": []} for mode in trainers}
    warm = micro_batches(1, size, seed + 1000)[0]
    for mode in trainers:  # warm-up step, not recorded
        timed_step(trainers[mode], collators[mode](warm))
    for r, examples in enumerate(micro_batches(rounds, size, seed)):
        order = ("packed", "padded") if r % 2 == 0 else ("padded", "packed")
        for mode in order:
            start = time.perf_counter()
            batch = collators[mode](examples)
            collate_s = time.perf_counter() - start
            stats = packing_metadata(batch)["stats"]
            rows[mode]["collate_s"].append(collate_s)
            rows[mode]["step_s"].append(timed_step(trainers[mode], batch))
            rows[mode]["real"].append(stats.real_tokens)
            rows[mode]["slots"].append(batch["input_ids"].numel())
    return rows


def report(rows: dict, rounds: int, size: int) -> str:
    packed, padded = (rows[m] for m in ("packed", "padded"))
    assert packed["real"] == padded["real"], "both layouts must carry the same real tokens"
    tps = {m: np.array(rows[m]["real"]) / np.array(rows[m]["step_s"]) for m in rows}
    ratio = tps["packed"] / tps["padded"]
    slot_ratio = np.array(padded["slots"]) / np.array(packed["slots"])
    p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
    lines = [
        "# Trainer step: packed vs padded (real tokens / s)",
        "",
        f"Tiny Qwen2-VL (hidden 64, 2 layers, Qwen vocabulary), micro-batch {size}, {rounds} paired rounds, "
        f"`Trainer.training_step` + SGD step, CPU, 1 thread. {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
        "| layout | median step (ms) | median real tokens / s | median slots / batch | median collate (ms) |",
        "|---|---|---|---|---|",
    ]
    for mode in ("packed", "padded"):
        r = rows[mode]
        lines.append(f"| {mode} | {1e3 * np.median(r['step_s']):.1f} | {np.median(tps[mode]):.0f} | "
                     f"{np.median(r['slots']):.0f} | {1e3 * np.median(r['collate_s']):.1f} |")
    lines += [
        "",
        f"Packed / padded real tokens per second: **{p50:.2f}x** median (10th-90th percentile {p10:.2f}x-{p90:.2f}x) "
        f"over paired rounds; padded slots / packed slots: {np.median(slot_ratio):.2f}x median (the ideal ratio if "
        "step time were proportional to slots).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text = report(run(args.rounds, args.micro_batch, args.seed), args.rounds, args.micro_batch)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trainer_step_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
