"""A GRPO training step, TRL's padded ``GRPOTrainer`` vs packed rollouts vs shared prompts (CPU), plus the token /
attention / vision FLOP counts of the same batches at Qwen2-VL-2B and -7B shapes.

Three trainers on the same rollouts, each through its own ``_prepare_inputs`` (rewards, advantages, the reference
forward: beta > 0) and ``training_step`` (policy forward + backward) plus an SGD step:

* ``trl``: ``trl.GRPOTrainer``: prompts left-padded, completions right-padded, every prompt and image G times;
* ``packed``: ``vlm_pack.PackedGRPOTrainer(share_prompts=False)``: one packed row, no pad slot;
* ``shared``: ``PackedGRPOTrainer`` (``share_prompts=True``): each prompt and its image once per group.

Generation is replaced by fixed completions (random lengths 50-400 tokens, seeded per round), identical for the
three. Tiny Qwen2-VL (hidden 64, 2 layers) with the real 151k-token vocabulary, 448x448 images (256 image tokens),
a ~395-token prompt, G = 8, 2-4 prompts per step (cycled), rounds in rotating order, process CPU time on one thread.
On CPU TRL's fused LM head projects EVERY slot of its padded batch onto the vocabulary (on CUDA only the scored
ones); the packed trainers gather the predicting slots first, so at this tiny width the head dominates and the CPU
ratio mostly counts slots. The analytic table (same batches, real 2B / 7B shapes, head on scored tokens only as on
CUDA) is the GPU-relevant picture. Run: ``python benchmarks/grpo.py [--rounds 3]``; writes
``benchmarks/results/grpo_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from trl import GRPOConfig, GRPOTrainer

from vlm_pack.rl import PackedGRPOTrainer
from vlm_pack.testing.data import sample_photos
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = ("trl", "packed", "shared")
G = 8
SIDE = 448
QUESTION = ("Look at this photograph carefully and describe every object you can see, where it is, its colour and "
            "texture, and what it tells you about the place and time the picture was taken. ")


def reward(completion_ids, **kwargs) -> list[float]:
    return [float(len(c) % 7) for c in completion_ids]


def rollouts(round_index: int, prompts: int) -> list[dict]:
    photos = sample_photos(max_side=SIDE)
    names = sorted(photos)
    rows = []
    for p in range(prompts):
        image = photos[names[(round_index + p) % len(names)]].resize((SIDE, SIDE))
        text = f"Photo {round_index}.{p}. " + QUESTION * 3
        rows += [{"prompt": [{"role": "user", "content": text}], "images": [image]}] * G
    return rows


def fixed_trainer(cls):
    class Fixed(cls):
        lengths: np.ndarray

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
            rng = np.random.default_rng(int(self.lengths_seed))
            return [rng.integers(10, 4000, size=int(n)).tolist() for n in self.lengths[:len(prompt_ids)]], None

    return Fixed


def make_trainer(layout: str, processor, out: str, model=None, **overrides):
    """The ``layout`` trainer on ``model`` (default: tiny Qwen2-VL, real vocabulary), CPU and fp32 unless
    ``overrides`` (GRPOConfig fields) say otherwise; benchmarks/gpu/grpo_step.py runs it on a GPU."""
    model = tiny_model("qwen2_vl", full_vocabulary=True) if model is None else model
    settings = dict(output_dir=out, per_device_train_batch_size=4 * G, num_generations=G, max_completion_length=400,
                    beta=0.04, optim="sgd", learning_rate=1e-3, max_grad_norm=0.0, use_cpu=True, bf16=False,
                    gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True)
    settings.update(overrides)
    if settings["beta"]:
        path = tempfile.mkdtemp(dir=out)
        model.save_pretrained(path)  # TRL builds the reference model (beta > 0) from the policy's path
        model.config._name_or_path = path
    args = GRPOConfig(**settings)
    kwargs = dict(model=model, reward_funcs=reward, args=args, processing_class=processor,
                  train_dataset=datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}]}]))
    if layout == "trl":
        trainer = fixed_trainer(GRPOTrainer)(**kwargs)
    else:
        trainer = fixed_trainer(PackedGRPOTrainer)(share_prompts=layout == "shared", **kwargs)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the steps here are driven directly
    trainer.model.train()
    return trainer


def timed_step(trainer, rows: list[dict]) -> tuple[float, dict]:
    start = time.process_time()
    trainer.training_step(trainer.model, rows, None)  # its _prepare_inputs scores the rollouts (reference forward)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.process_time() - start, trainer._buffered_inputs[0]


# ---------------------------------------------------------------- analytic counts at real shapes

@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    vision_dim: int = 1280
    vision_depth: int = 32


SHAPES = (Shape("Qwen2-VL-2B", 1536, 28, 8960, 12, 2, 151936), Shape("Qwen2-VL-7B", 3584, 28, 18944, 28, 4, 152064))


def layout_counts(prompt: list[int], completions: list[list[int]], layout: str) -> dict[str, float]:
    """LM tokens, causal attention pairs (query-key), images encoded and scored tokens of one step's batch.

    ``prompt[p]``: prompt length of group p; ``completions[p]``: its G completion lengths."""
    if layout == "trl":
        width = max(prompt) + max(max(c) for c in completions)
        rows = sum(len(c) for c in completions)
        tokens, pairs = rows * width, rows * width * (width + 1) / 2
    elif layout == "packed":
        seqs = [p + c for p, cs in zip(prompt, completions) for c in cs]
        tokens, pairs = sum(seqs), sum(s * (s + 1) / 2 for s in seqs)
    else:
        tokens = sum(prompt) + sum(sum(cs) for cs in completions)
        pairs = sum(p * (p + 1) / 2 + sum(c * p + c * (c + 1) / 2 for c in cs) for p, cs in zip(prompt, completions))
    images = len(prompt) * (1 if layout == "shared" else G)
    scored = sum(sum(cs) for cs in completions)
    return {"tokens": tokens, "pairs": pairs, "images": images, "scored": scored}


def forward_tflop(counts: dict[str, float], shape: Shape, patches: int) -> float:
    """Forward FLOPs (2 per multiply-add): projections + MLP per LM token, QK^T and AV per causal pair, the LM head
    on scored tokens (as TRL's fused head does on CUDA), the vision tower per image (full attention over patches)."""
    head_dim = shape.hidden // shape.heads
    per_token = 2 * shape.layers * (shape.hidden * shape.hidden * 2 + 2 * shape.hidden * shape.kv_heads * head_dim
                                    + 3 * shape.hidden * shape.intermediate)
    attention = 4 * shape.layers * shape.hidden * counts["pairs"]
    head = 2 * shape.vocab * shape.hidden * counts["scored"]
    e = shape.vision_dim
    per_image = 2 * shape.vision_depth * patches * 12 * e * e + 4 * shape.vision_depth * e * patches ** 2
    vision = counts["images"] * per_image
    return (per_token * counts["tokens"] + attention + head + vision) / 1e12


# ---------------------------------------------------------------- run and report

def run(rounds: int, seed: int, dump=None) -> dict:
    torch.set_num_threads(1)
    processor = offline_qwen2vl_processor(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE, full_vocabulary=True)
    processor.tokenizer.padding_side = "left"
    out = tempfile.mkdtemp()
    trainers = {layout: make_trainer(layout, processor, out) for layout in LAYOUTS}
    rows = {layout: {"step_s": []} for layout in LAYOUTS}
    batches = []
    for r in range(rounds + 1):
        prompts = 2 + (r - 1) % 3 if r else 1  # a small warm-up round (1 prompt, short completions), then 2, 3, 4, 2...
        lengths = np.random.default_rng(seed + r).integers(50, 401 if r else 60, size=prompts * G)
        for layout in LAYOUTS[r % 3:] + LAYOUTS[:r % 3]:
            trainer = trainers[layout]
            trainer.lengths, trainer.lengths_seed = lengths, seed + r
            step_s, inputs = timed_step(trainer, rollouts(r, prompts))
            if r == 0:
                continue
            rows[layout]["step_s"].append(step_s)
            if layout == "trl":
                prompt = inputs["prompt_mask"].sum(1).view(-1, G)[:, 0].tolist()
                completions = inputs["completion_mask"].sum(1).view(-1, G).tolist()
                batches.append((prompt, completions))
        if r and dump is not None:  # after every round: an interrupted run keeps its finished rounds
            dump({"rows": rows, "batches": batches})
    return {"rows": rows, "batches": batches}


def report(result: dict, rounds: int) -> str:
    rows, batches = result["rows"], result["batches"]
    done = min(len(rows[layout]["step_s"]) for layout in LAYOUTS)  # rounds every layout finished
    step = {layout: np.array(rows[layout]["step_s"][:done]) for layout in LAYOUTS}
    batches = batches[:done]
    rounds = done

    def spread(ratio: np.ndarray) -> str:
        p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
        return f"**{p50:.2f}x** median ({p10:.2f}x-{p90:.2f}x, 10th-90th percentile)"

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# GRPO step: TRL's padded GRPOTrainer vs packed rollouts vs shared prompts",
        "",
        f"Tiny Qwen2-VL (hidden 64, 2 layers, real 151k-token vocabulary), {SIDE}x{SIDE} images (256 image tokens), "
        f"prompts of ~395 tokens, G = {G} completions of 50-400 tokens (fixed ids, seeded), 2-4 prompts per step, "
        f"{rounds} timed round(s) after a warm-up, rotating order; `_prepare_inputs` (rewards, advantages, reference "
        f"forward, beta = 0.04) + `training_step` (policy forward + backward) + SGD step; process CPU time, 1 thread, "
        f"load average {load:.1f} at the end (a shared machine). {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, transformers {transformers.__version__}.",
        "",
        "| layout | median step (CPU s) | mean LM tokens / step (one forward) |",
        "|---|---|---|",
    ]
    for layout in LAYOUTS:
        tokens = np.mean([layout_counts(p, c, layout)["tokens"] for p, c in batches])
        lines.append(f"| {layout} | {np.median(step[layout]):.1f} | {tokens:,.0f} |")
    lines += [
        "",
        f"Step-time speedup over TRL's padded step: packed {spread(step['trl'] / step['packed'])}; shared prompts "
        f"{spread(step['trl'] / step['shared'])}. Shared prompts over plain packing: "
        f"{spread(step['packed'] / step['shared'])}.",
        "At this tiny width the 151k-row LM head dominates: on CPU TRL's fused head projects every padded slot, the "
        "packed trainers only the scored completion tokens. The counts below put the same batches on real shapes.",
        "",
        "## The same batches at Qwen2-VL-2B / 7B shapes (one forward; LM head on scored tokens only, as on CUDA)",
        "",
        "| layout | LM tokens | causal attention pairs | images encoded | forward TFLOP 2B | forward TFLOP 7B |",
        "|---|---|---|---|---|---|",
    ]
    patches = (SIDE // 14) ** 2
    totals = {}
    for layout in LAYOUTS:
        counts = [layout_counts(p, c, layout) for p, c in batches]
        summed = {k: sum(c[k] for c in counts) / len(counts) for k in counts[0]}
        flops = [sum(forward_tflop(c, s, patches) for c in counts) / len(counts) for s in SHAPES]
        totals[layout] = flops
        lines.append(f"| {layout} | {summed['tokens']:,.0f} | {summed['pairs'] / 1e6:.2f}M | {summed['images']:.0f} | "
                     f"{flops[0]:.1f} | {flops[1]:.1f} |")
    lines += [
        "",
        "Means per step over the timed rounds' batches. Forward FLOP ratio TRL / shared prompts: "
        f"{totals['trl'][0] / totals['shared'][0]:.2f}x (2B), {totals['trl'][1] / totals['shared'][1]:.2f}x (7B); "
        f"TRL / packed: {totals['trl'][0] / totals['packed'][0]:.2f}x (2B), "
        f"{totals['trl'][1] / totals['packed'][1]:.2f}x (7B). FLOPs: 2 x multiply-adds of the projections and MLP per "
        "LM token (pad slots included for TRL, which computes them), 4 x layers x hidden per causal query-key pair, "
        "the vision tower per image (32 blocks of width 1280 over 1024 patches, full attention), the LM head per "
        "scored token.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-only", action="store_true", help="re-render grpo_cpu.md from grpo_cpu.json")
    args = parser.parse_args()
    if args.report_only:
        result = json.loads((RESULTS / "grpo_cpu.json").read_text())
        text = report(result, len(result["batches"]))
        (RESULTS / "grpo_cpu.md").write_text(text)
        print(text)
        return
    RESULTS.mkdir(exist_ok=True)
    raw = RESULTS / "grpo_cpu.json"  # raw timings and batch shapes, rewritten after every round
    result = run(args.rounds, args.seed, dump=lambda partial: raw.write_text(json.dumps(partial)))
    text = report(result, args.rounds)
    (RESULTS / "grpo_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
