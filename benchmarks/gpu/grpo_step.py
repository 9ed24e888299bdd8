"""Stage e: one GRPO step, TRL's padded ``GRPOTrainer`` vs ``PackedGRPOTrainer`` (packed rollouts) vs shared
prompts, at Qwen2-VL-2B's shape (random bf16 weights, benchmarks/gpu/shapes.py), G = 8.

The code is benchmarks/grpo.py's: the same fixed rollouts (generation replaced by seeded completions of 50-400
tokens), 448x448 photos (256 image tokens) and ~395-token prompts, each trainer's own ``_prepare_inputs`` +
``training_step`` + SGD step. Here on the device, wall time with a sync, one layout at a time (one policy in
memory), beta = 0 (no reference model: saving and reloading a 2B model would cost more than the step itself).
Reported: real tokens (prompt + completion per rollout) / s, peak memory, and grpo.py's analytic forward FLOPs of
the same batches.
"""

from __future__ import annotations

import tempfile

import numpy as np

from benchmarks.gpu import shapes
from benchmarks.gpu.common import Context, Result, error_text, fmt, is_oom, measure, release, require, require_cuda, table


def _settings(ctx: Context) -> dict:
    if ctx.dry:
        return {"rounds": 1, "prompts": 1, "completions": (10, 30), "warm_up": False}
    return {"rounds": 2, "prompts": 2, "completions": (50, 401), "warm_up": True}


def _layout(layout: str, ctx: Context, settings: dict, grpo) -> dict:
    import torch

    processor = (grpo.offline_qwen2vl_processor() if ctx.dry else grpo.offline_qwen2vl_processor(
        min_pixels=grpo.SIDE * grpo.SIDE, max_pixels=grpo.SIDE * grpo.SIDE, full_vocabulary=True))
    processor.tokenizer.padding_side = "left"
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    torch.manual_seed(0)
    model = shapes.build("qwen2_vl", ctx.dry, ctx.device, dtype)
    trainer = grpo.make_trainer(layout, processor, tempfile.mkdtemp(), model=model, beta=0.0,
                                use_cpu=not ctx.cuda, bf16=ctx.cuda)
    entry = {"seconds": [], "peak_mib": [], "batches": [], "error": None}
    for r in range(0 if settings["warm_up"] else 1, settings["rounds"] + 1):
        prompts = settings["prompts"] if r else 1
        low, high = settings["completions"]
        trainer.lengths = np.random.default_rng(r).integers(low, high if r else low + 10, size=prompts * grpo.G)
        trainer.lengths_seed = r
        rows = grpo.rollouts(r, prompts)
        try:
            seconds, peak = measure(lambda: grpo.timed_step(trainer, rows), ctx.device)
        except Exception as error:  # noqa: BLE001 - recorded; the next layout runs
            entry["error"] = "out of memory" if is_oom(error) else error_text(error)
            break
        if r:
            inputs = trainer._buffered_inputs[0]
            entry["seconds"].append(seconds)
            entry["peak_mib"].append(peak)
            if layout == "trl":
                entry["batches"].append((inputs["prompt_mask"].sum(1).view(-1, grpo.G)[:, 0].tolist(),
                                         inputs["completion_mask"].sum(1).view(-1, grpo.G).tolist()))
    del trainer, model
    release(ctx.device)
    return entry


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    require("trl", "trl")
    require("datasets", "datasets")
    require("vlm_pack.testing.data", "scikit-image / easy-vqa")
    from benchmarks import grpo

    settings = _settings(ctx)
    runs = {}
    for layout in grpo.LAYOUTS:
        try:
            runs[layout] = _layout(layout, ctx, settings, grpo)
        except Exception as error:  # noqa: BLE001 - building the trainer failed: recorded, the next layout runs
            import traceback

            traceback.print_exc()
            runs[layout] = {"seconds": [], "peak_mib": [], "batches": [], "error": error_text(error)}
            release(ctx.device)
        ctx.save({"layouts": {k: {x: y for x, y in v.items() if x != "batches"} for k, v in runs.items()}})
    batches = runs["trl"]["batches"]
    real = [grpo.layout_counts(p, c, "packed")["tokens"] for p, c in batches]
    patches = (grpo.SIDE // 14) ** 2
    data = {"G": grpo.G, "rounds": settings["rounds"], "real_tokens_per_step": float(np.mean(real)) if real else None,
            "layouts": {}}
    for layout in grpo.LAYOUTS:
        entry = runs[layout]
        out = {"error": entry["error"]}
        if real and len(entry["seconds"]) == len(real):
            seconds = np.array(entry["seconds"])
            out.update(step_s=float(np.median(seconds)), tokens_per_s=float(np.median(np.array(real) / seconds)),
                       peak_mib=None if entry["peak_mib"][0] is None else float(max(entry["peak_mib"])))
        if batches:
            out["analytic_forward_tflop_2b"] = float(np.mean(
                [grpo.forward_tflop(grpo.layout_counts(p, c, layout), grpo.SHAPES[0], patches) for p, c in batches]))
        data["layouts"][layout] = out
    base = data["layouts"]["trl"].get("tokens_per_s")
    lines = [f"G = {grpo.G}, {settings['prompts']} prompt(s) per step, {settings['rounds']} timed step(s) after a "
             "warm-up (none in the dry run), beta = 0, SGD; real tokens = prompt + completion per rollout "
             f"({fmt(data['real_tokens_per_step'], '.0f')} per step).", ""]
    lines += table(["layout", "step s", "real tokens / s", "vs TRL", "peak MiB", "analytic forward TFLOP (2B)"],
                   [[layout, e["error"] or fmt(e.get("step_s"), ".3f"), fmt(e.get("tokens_per_s"), ".0f"),
                     fmt(e["tokens_per_s"] / base if base and "tokens_per_s" in e else None), fmt(e.get("peak_mib"), ".0f"),
                     fmt(e.get("analytic_forward_tflop_2b"), ".2f")] for layout, e in data["layouts"].items()])
    checks = {f"{layout} ran": not e["error"] or e["error"] == "out of memory" for layout, e in data["layouts"].items()}
    return Result(lines, data, checks)
