"""Stage d: speed and memory of one training step (forward, the model's own loss, backward, AdamW), bf16, random
weights at real shapes (benchmarks/gpu/shapes.py), three layouts of the SAME micro-batches, interleaved:

* ``packed``: ``enable_packing`` + ``VLMPackingCollator``: one row, ``cu_seq_lens_*``, no mask;
* ``padded``: the stock ``sdpa`` model on the right-padded batch without an attention mask (causal, so the real
  tokens are exact: the fastest padded baseline);
* ``padded+mask``: the same batch with its attention mask (what a padded collator normally sends).

Micro-batches: real ShareGPT lengths (clipped like ``max_length``) until a token budget is filled; for the VLM
every other sample has a photo at its own size. Reported: real tokens / s, MFU (model FLOPs on the real tokens,
attention and vision tower included, over the GPU's dense bf16 peak), peak memory, the ideal slot ratio (padded
slots / packed slots) beside the measured speed-up. An out-of-memory layout is recorded as such.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu import shapes
from benchmarks.gpu.common import (Context, Result, bf16_peak_tflops, draw_lengths, fmt, is_oom, measure, release,
                                   require, require_cuda, table)

LAYOUTS = ("packed", "padded", "padded+mask")


def _settings(ctx: Context) -> dict:
    if ctx.dry:
        return {"budget": 300, "cap": 96, "rounds": 1, "dtype": torch.bfloat16}
    # ~4k real tokens + images per micro-batch: the padded layouts of the same samples (~2.5x the slots, no
    # activation checkpointing) still fit 80 GB beside the 2.2B model's weights, gradients and AdamW states
    return {"budget": 4096, "cap": 2048, "rounds": 3, "dtype": torch.bfloat16}


def _batches(kind: str, ctx: Context, settings: dict, rng: np.random.Generator, model) -> list[dict]:
    """(warm-up + rounds) micro-batches, each collated the three ways."""
    from vlm_pack import VLMPackingCollator
    from vlm_pack.core.batch import packing_metadata

    data = require("vlm_pack.testing.data", "scikit-image / easy-vqa")
    photos = list(data.sample_photos(max_side=112 if ctx.dry else 640).values()) if kind == "qwen2_vl" else None
    proc = shapes.processor(kind, ctx.dry)
    packed = VLMPackingCollator(proc, max_length=4 * settings["cap"], model_config=model.config)
    padded = VLMPackingCollator(proc, max_length=4 * settings["cap"], model_config=model.config,
                                pack_sequences_in_batch=False)
    out = []
    for _ in range(settings["rounds"] + 1):
        examples = shapes.chat_examples(rng, draw_lengths(rng, settings["budget"], settings["cap"]), photos)
        row, rect = packed(examples), padded(examples)
        meta = packing_metadata(row)
        grid = row.get("image_grid_thw")
        patches = [] if grid is None else grid.prod(-1).tolist()
        out.append({"packed": row, "padded": {k: v for k, v in rect.items() if k != "attention_mask"},
                    "padded+mask": rect, "lengths": meta["seq_lengths"].tolist(), "patches": patches,
                    "slots": {"packed": row["input_ids"].numel(), "padded": rect["input_ids"].numel(),
                              "padded+mask": rect["input_ids"].numel()}})
    return out


def _device_batch(batch: dict, device: str, dtype: torch.dtype) -> dict:
    from vlm_pack import model_inputs

    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) if torch.is_tensor(v)
            else v for k, v in model_inputs(batch, keep_labels=True).items()}


def measure_model(kind: str, ctx: Context, settings: dict) -> dict:
    from vlm_pack import enable_packing
    from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION

    rng = np.random.default_rng(0)
    model = shapes.build(kind, ctx.dry, ctx.device, settings["dtype"])
    params = sum(p.numel() for p in model.parameters())
    enable_packing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ctx.cuda)
    batches = _batches(kind, ctx, settings, rng, model)
    runs = {layout: {"seconds": [], "peak_mib": [], "error": None} for layout in LAYOUTS}
    for r, item in enumerate(batches):
        order = LAYOUTS[r % 3:] + LAYOUTS[:r % 3]
        for layout in order:
            if runs[layout]["error"]:
                continue
            model.set_attn_implementation(ATTN_IMPLEMENTATION if layout == "packed" else "sdpa")
            batch = _device_batch(item[layout], ctx.device, settings["dtype"])

            def step():
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            try:
                seconds, peak = measure(step, ctx.device)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
                if not is_oom(error):
                    raise
                optimizer.zero_grad(set_to_none=True)
                runs[layout]["error"] = f"out of memory at {item['slots'][layout]} slots"
                release(ctx.device)
                continue
            if r:  # round 0 is the warm-up
                runs[layout]["seconds"].append(seconds)
                runs[layout]["peak_mib"].append(peak)
    timed = batches[1:]
    real = [sum(b["lengths"]) for b in timed]
    flops = [shapes.step_flops(model, b["lengths"], b["patches"]) for b in timed]
    peak_tflops, gpu = bf16_peak_tflops(ctx.device)
    result = {"model": kind, "parameters": params, "gpu": gpu, "bf16_peak_tflops": peak_tflops,
              "real_tokens_per_batch": float(np.mean(real)),
              "slot_ratio_padded_over_packed": float(np.mean([b["slots"]["padded"] / b["slots"]["packed"]
                                                              for b in timed])),
              "layouts": {}}
    for layout in LAYOUTS:
        run = runs[layout]
        entry = {"error": run["error"], "slots": float(np.mean([b["slots"][layout] for b in timed]))}
        if run["seconds"] and len(run["seconds"]) == len(timed):
            seconds = np.array(run["seconds"])
            entry.update(step_s=float(np.median(seconds)), tokens_per_s=float(np.median(np.array(real) / seconds)),
                         peak_mib=None if run["peak_mib"][0] is None else float(max(run["peak_mib"])),
                         mfu=None if peak_tflops is None else float(np.median(np.array(flops) / seconds)) / (peak_tflops * 1e12))
        result["layouts"][layout] = entry
    packed = result["layouts"]["packed"]
    for layout in ("padded", "padded+mask"):
        other = result["layouts"][layout]
        if "tokens_per_s" in packed and "tokens_per_s" in other:
            result[f"speedup_over_{layout}"] = packed["tokens_per_s"] / other["tokens_per_s"]
    del model, optimizer, batches
    release(ctx.device)
    return result


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    settings = _settings(ctx)
    results = []
    for kind in ("qwen2_vl", "text"):
        results.append(measure_model(kind, ctx, settings))
        ctx.save({"models": results})
    lines = [f"One step (forward + loss + backward + AdamW), {str(settings['dtype']).replace('torch.', '')}, "
             f"micro-batches of ~{settings['budget']} real tokens from the ShareGPT lengths (clipped to "
             f"{settings['cap']}), {settings['rounds']} timed round(s) after a warm-up, layouts interleaved. "
             f"GPU: {results[0]['gpu']} (bf16 peak {fmt(results[0]['bf16_peak_tflops'], '.0f')} TFLOP/s).", ""]
    rows = []
    for r in results:
        for layout in LAYOUTS:
            e = r["layouts"][layout]
            rows.append([f"{r['model']} ({r['parameters'] / 1e9:.2f}B)", layout, fmt(e["slots"], ".0f"),
                         e["error"] or fmt(e.get("step_s"), ".3f"), fmt(e.get("tokens_per_s"), ".0f"),
                         fmt(e.get("mfu"), ".1%"), fmt(e.get("peak_mib"), ".0f")])
    lines += table(["model", "layout", "slots / batch", "step s", "real tokens / s", "MFU", "peak MiB"], rows)
    lines += [""] + [f"{r['model']}: packed / padded {fmt(r.get('speedup_over_padded'))}x, packed / padded+mask "
                     f"{fmt(r.get('speedup_over_padded+mask'))}x; ideal (padded slots / packed slots) "
                     f"{r['slot_ratio_padded_over_packed']:.2f}x" for r in results]
    return Result(lines, {"models": results})
