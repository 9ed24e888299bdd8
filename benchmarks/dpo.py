"""A DPO training step, packed vs TRL's padded collator, and shared prompts vs plain packing (CPU).

Three layouts of the same preference micro-batches, each through its trainer's own ``training_step`` (policy
forward + backward, reference forward) plus an SGD step:

* ``trl``: ``trl.DPOTrainer`` with its ``DataCollatorForVisionPreference`` (chosen and rejected right-padded to the
  longest sequence, prompts left-flushed) on the stock ``sdpa`` model;
* ``packed``: ``PackedDPOTrainer`` + ``PreferenceCollator``: all 2 x pairs sequences in one row;
* ``shared``: the same with ``shared_prompts=True``: each prompt and its images once per pair.

The preference mix: prompts with 1-3 photos of several sizes, easy-vqa questions with one image, and multi-turn
text chats; the chosen answer is the dataset's, the rejected one another example's answer. Rounds alternate the
order of the three layouts; each round gives paired ratios of step time. Throughput counts the same tokens for
every layout (prompt + chosen and prompt + rejected, what an unpacked step processes), so the ratios are speedups.
Times are this process's CPU seconds (``time.process_time``, one intra-op thread), so other processes on a
shared machine inflate them less than wall time. On CPU, TRL's fused LM head projects EVERY slot of a batch onto
the vocabulary (on CUDA only the completion slots), so with the 151k-token Qwen vocabulary the step time here
tracks the number of slots. Run: ``python benchmarks/dpo.py [--rounds 10] [--pairs 8]``; writes
``benchmarks/results/dpo_cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from trl import DPOConfig, DPOTrainer

from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.preference import PackedDPOTrainer, PreferenceCollator
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = ("trl", "packed", "shared")


def to_pair(example: dict, other: dict) -> dict:
    """A chat example -> a TRL preference pair: its last answer chosen, ``other``'s last answer rejected."""
    messages = example["messages"]
    images = [part.pop("image") for m in messages if isinstance(m["content"], list) for part in m["content"]
              if part.get("type") == "image" and "image" in part]
    # TRL's vision collator reads "images" from every example of a batch (an empty list for a text prompt)
    return {"prompt": messages[:-1], "chosen": [messages[-1]], "rejected": [other["messages"][-1]], "images": images}


def micro_batches(rounds: int, pairs: int, seed: int) -> list[list[dict]]:
    """Image prompts (photos, easy-vqa with its image loaded) and text chats, shuffled; every batch has images."""
    from PIL import Image

    third = max(1, pairs // 3)
    batches = []
    for r in range(rounds):
        vqa = easy_vqa_examples(third, seed=seed + r)
        for example in vqa:  # TRL's vision collator takes PIL images, not paths
            part = example["messages"][0]["content"][0]
            part["image"] = Image.open(part.pop("path")).convert("RGB")
        chats = photo_examples(third, seed=seed + r) + vqa + text_chat_examples(pairs - 2 * third, seed=seed + r)
        rng = np.random.default_rng(seed + r)
        rng.shuffle(chats)
        batches.append([to_pair(chats[i], chats[(i + 1) % len(chats)]) for i in range(len(chats))])
    return batches


def make_trainer(layout: str, processor, batch: list[dict], out: str, seed: int):
    model, ref = (tiny_model("qwen2_vl", seed=seed + i, full_vocabulary=True) for i in (0, 1))
    args = DPOConfig(output_dir=out, per_device_train_batch_size=len(batch), optim="sgd", learning_rate=1e-3,
                     max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                     save_strategy="no", disable_tqdm=True, max_length=None)
    kwargs = dict(model=model, ref_model=ref, args=args, processing_class=processor,
                  train_dataset=datasets.Dataset.from_list(batch[:1]))
    if layout == "trl":
        trainer = DPOTrainer(**kwargs)
    else:
        collator = PreferenceCollator(processor, model_config=model.config, shared_prompts=layout == "shared")
        trainer = PackedDPOTrainer(data_collator=collator, **kwargs)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the steps here are driven directly
    return trainer


def timed_step(trainer, batch: dict) -> float:
    start = time.process_time()
    trainer.training_step(trainer.model, batch)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.process_time() - start


def unpacked_tokens(batch: dict) -> int:
    """Tokens of every prompt + completion sequence (TRL's attention mask): the same work for every layout."""
    return int(batch["attention_mask"].sum())


def run(rounds: int, pairs: int, seed: int) -> dict:
    torch.set_num_threads(1)
    processor = offline_qwen2vl_processor(full_vocabulary=True)
    batches = micro_batches(rounds + 1, pairs, seed)
    out = tempfile.mkdtemp()
    trainers = {layout: make_trainer(layout, processor, batches[0], out, seed) for layout in LAYOUTS}
    rows = {layout: {"step_s": [], "collate_s": [], "slots": []} for layout in LAYOUTS}
    tokens = []
    for r, examples in enumerate(batches):
        order = LAYOUTS[r % 3:] + LAYOUTS[:r % 3]
        for layout in order:
            trainer = trainers[layout]
            start = time.process_time()
            batch = trainer._prepare_inputs(trainer.data_collator([dict(e) for e in examples]))
            collate_s = time.process_time() - start
            step_s = timed_step(trainer, batch)
            if r == 0:  # warm-up round, not recorded
                continue
            if layout == "trl":
                tokens.append(unpacked_tokens(batch))
            rows[layout]["step_s"].append(step_s)
            rows[layout]["collate_s"].append(collate_s)
            rows[layout]["slots"].append(batch["input_ids"].numel())
    return {"rows": rows, "tokens": tokens}


def report(result: dict, rounds: int, pairs: int) -> str:
    rows, tokens = result["rows"], np.array(result["tokens"])
    tps = {layout: tokens / np.array(rows[layout]["step_s"]) for layout in LAYOUTS}

    def spread(ratio: np.ndarray) -> str:
        p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
        return f"**{p50:.2f}x** median (10th-90th percentile {p10:.2f}x-{p90:.2f}x)"

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# DPO step: packed vs TRL's padded collator, shared prompts vs plain packing",
        "",
        f"Tiny Qwen2-VL (hidden 64, 2 layers, Qwen vocabulary), {pairs} preference pairs per micro-batch (prompts "
        f"with 1-3 photos, easy-vqa with an image, text chats), {rounds} rounds in rotating order, "
        f"`training_step` (policy forward + backward, reference forward) + SGD step, process CPU time, 1 thread, load "
        f"average {load:.1f} at the end (a shared machine). {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}.",
        "",
        "| layout | median step (CPU ms) | median tokens / CPU s | median slots / batch | median collate (CPU ms) |",
        "|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        r = rows[layout]
        lines.append(f"| {layout} | {1e3 * np.median(r['step_s']):.0f} | {np.median(tps[layout]):.0f} | "
                     f"{np.median(r['slots']):.0f} | {1e3 * np.median(r['collate_s']):.0f} |")
    lines += [
        "",
        f"Packed / TRL padded tokens per second: {spread(tps['packed'] / tps['trl'])}.",
        f"Shared prompts / plain packing: {spread(tps['shared'] / tps['packed'])}; "
        f"shared prompts / TRL padded: {spread(tps['shared'] / tps['trl'])}.",
        "Tokens per second count every prompt + completion sequence once per layout (the same numerator), so the "
        "ratios are step-time speedups. TRL's fused LM head scores every slot on CPU (151k-token vocabulary): the "
        "step time tracks slots per batch here; on CUDA it scores completion slots only.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text = report(run(args.rounds, args.pairs, args.seed), args.rounds, args.pairs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dpo_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
