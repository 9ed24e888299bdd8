"""Stage d: speed and memory of one training step (forward, the model's own loss, backward, then AdamW), bf16,
random weights at real shapes (benchmarks/gpu/shapes.py), activation checkpointing on (how 16k-token steps are
trained), the SAME samples in every layout, layouts interleaved round by round:

* ``packed``: ``enable_packing`` + ``VLMPackingCollator``: one row of at most the token budget, ``cu_seq_lens_*``,
  no mask, attention through the route ``auto`` picks (named in the report, with any KV-head repeat);
* ``packed via <route>``: the same rows through a route that keeps grouped-query attention native (flex on CUDA),
  measured only where ``auto`` picked a route that repeats KV heads (torch_varlen without ``enable_gqa``), so the
  report shows which wins;
* ``padded``: the stock ``sdpa`` model on right-padded micro-batches of the same samples (arrival order, at most
  the token budget in slots each, gradients accumulated), no attention mask (causal: the real tokens are exact;
  the fastest padded baseline); ``padded+mask``: the same with the attention mask (what a padded collator sends).
  The SDPA backend each hits (``torch._fused_sdp_choice`` on the call's own tensors) is named.

Micro-batches: real ShareGPT lengths clipped to 4k tokens (``max_length`` truncation) until a 16k-token budget is
filled: a long-tailed mix; for the VLM every other sample has a photo at its own size. Timed with CUDA events:
forward + backward apart from the optimiser step. Memory: the peak during forward + backward minus what was held
before the step (weights, optimiser state: the activation peak) beside the total peak. Real tokens / s, MFU
(model FLOPs of the real tokens, attention and vision tower included, recompute excluded, over the GPU's dense
bf16 peak), the ideal slot ratio (padded slots / packed slots) beside the measured speed-up. A layout that fails
(out of memory, a kernel error) is recorded as such and the others go on.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.gpu import shapes
from benchmarks.gpu.common import (Context, Result, bf16_peak_tflops, draw_lengths, fmt, recorded, release, require,
                                   require_cuda, table)
from benchmarks.gpu.kernels import kv_repeat

PADDED = ("padded", "padded+mask")
GOAL = 2.0  # packed / padded real tokens / s on the long-tailed VLM mix at the 2B shape


def _settings(ctx: Context) -> dict:
    if ctx.dry:
        return {"budget": 300, "cap": 96, "rounds": 1, "dtype": torch.bfloat16}
    return {"budget": 16384, "cap": 4096, "rounds": 3, "dtype": torch.bfloat16}


def alternative_route(ctx: Context) -> str:
    """The packed route that keeps GQA native: flex on CUDA, the per-segment SDPA path on CPU."""
    return "flex" if ctx.cuda else "sdpa_segments"


class AttentionRecorder:
    """During a layout's warm-up step (``record=True``): every varlen call of the packed model (its route, KV repeat)
    and every SDPA call (the backend ``torch._fused_sdp_choice`` picks for its own tensors, GQA native or not),
    counted by kind. ``force`` overrides the packed route in every step; timed steps record nothing (the recording
    costs host time inside the timed region). A recording wrapper, read-only but for ``force``."""

    def __init__(self, force: str | None = None):
        self.force = force
        self.calls: Counter = Counter()
        self._routes: dict[tuple, str] = {}

    def _route(self, q: torch.Tensor, backend: str, blocks: bool, softcap: bool) -> str:
        from vlm_pack.attention.varlen import select_backend

        if self.force or backend != "auto":
            return self.force or backend
        key = (q.device.type, q.dtype, blocks, softcap)
        if key not in self._routes:  # select_backend probes the installed kernels: once per kind
            self._routes[key] = select_backend(q.device, q.dtype, image_blocks=blocks, softcap=softcap)
        return self._routes[key]

    @contextlib.contextmanager
    def active(self, record: bool = True):
        from vlm_pack.integrations import hf_model

        if not record and self.force is None:
            yield self
            return
        varlen, sdpa = hf_model.varlen_attention, F.scaled_dot_product_attention

        def forcing_varlen(q, k, v, *args, backend="auto", **kwargs):
            return varlen(q, k, v, *args, backend=self.force, **kwargs)

        def recording_varlen(q, k, v, *args, backend="auto", block_ids=None, softcap=None, **kwargs):
            route = self._route(q, backend, block_ids is not None, softcap is not None)
            repeat = kv_repeat(route, q.shape[1], k.shape[1])
            self.calls[f"varlen {route} ({q.shape[1]} q / {k.shape[1]} kv heads, "
                       + ("native GQA" if repeat == 1 else f"KV heads repeated {repeat}x") + ")"] += 1
            return varlen(q, k, v, *args, backend=route, block_ids=block_ids, softcap=softcap, **kwargs)

        def recording_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False, **kwargs):
            try:
                from torch.nn.attention import SDPBackend

                name = SDPBackend(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                                         scale=scale, enable_gqa=enable_gqa)).name
            except Exception as error:  # noqa: BLE001 - the name is a report detail, never the stage
                name = f"unknown ({type(error).__name__})"
            what = "mask" if attn_mask is not None else ("causal" if is_causal else "full")
            gqa = ", enable_gqa" if enable_gqa else ""
            self.calls[f"sdpa {name} ({what}, {query.shape[-3]} q / {key.shape[-3]} kv heads{gqa})"] += 1
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, **kwargs)

        hf_model.varlen_attention = recording_varlen if record else forcing_varlen
        if record:
            F.scaled_dot_product_attention = recording_sdpa
        try:
            yield self
        finally:
            hf_model.varlen_attention, F.scaled_dot_product_attention = varlen, sdpa

    def summary(self) -> str:
        return "; ".join(f"{kind} x{count}" for kind, count in self.calls.items()) or "no attention call seen"


def _groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices in arrival order, cut so that each padded micro-batch holds at most ``budget`` slots."""
    groups, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    return groups + [current] if current else groups


def _batches(kind: str, ctx: Context, settings: dict, rng: np.random.Generator, model) -> list[dict]:
    """(warm-up + rounds) steps: each the packed row and the padded micro-batches of the same samples."""
    from vlm_pack import VLMPackingCollator
    from vlm_pack.core.batch import packing_metadata

    data = require("vlm_pack.testing.data", "scikit-image / easy-vqa")
    photos = list(data.sample_photos(max_side=112 if ctx.dry else 640).values()) if kind == "qwen2_vl" else None
    proc = shapes.processor(kind, ctx.dry)
    packed = VLMPackingCollator(proc, max_length=4 * settings["budget"], model_config=model.config)
    padded = VLMPackingCollator(proc, max_length=4 * settings["cap"], model_config=model.config,
                                pack_sequences_in_batch=False)
    out = []
    for round_index in range(settings["rounds"] + 1):
        examples = shapes.chat_examples(rng, draw_lengths(rng, settings["budget"], settings["cap"]), photos)
        row = packed(examples)
        meta = packing_metadata(row)
        lengths = padded(examples)["attention_mask"].sum(1).tolist()  # per sample, in arrival order
        rects = [padded([examples[i] for i in group]) for group in _groups(lengths, settings["budget"])]
        grid = row.get("image_grid_thw")
        out.append({"packed": [row], "padded": [{k: v for k, v in r.items() if k != "attention_mask"} for r in rects],
                    "padded+mask": rects, "lengths": meta["seq_lengths"].tolist(), "round": round_index,
                    "patches": [] if grid is None else grid.prod(-1).tolist(),
                    "slots": {"packed": row["input_ids"].numel(),
                              "padded": sum(r["input_ids"].numel() for r in rects)}})
    return out


def _device_batch(batch: dict, device: str, dtype: torch.dtype) -> dict:
    from vlm_pack import model_inputs

    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) if torch.is_tensor(v)
            else v for k, v in model_inputs(batch, keep_labels=True).items()}


def _step(model, optimizer, micro: list[dict], ctx: Context) -> dict:
    """One optimiser step over ``micro``: fwd + bwd seconds (CUDA events) apart from the AdamW step's; the memory
    held before the step, the fwd + bwd peak and the step's total peak (MiB; None on CPU)."""
    cuda = ctx.cuda
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
    else:
        ticks = [time.perf_counter()]
    for batch in micro:
        model(**batch).loss.backward()
    if cuda:
        marks[1].record()
        torch.cuda.synchronize()
        fwd_bwd_peak = torch.cuda.max_memory_allocated()
    else:
        ticks.append(time.perf_counter())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        marks[2].record()
        marks[2].synchronize()
        return {"fwd_bwd_s": marks[0].elapsed_time(marks[1]) / 1e3, "optimizer_s": marks[1].elapsed_time(marks[2]) / 1e3,
                "held_mib": before / 2**20, "activation_peak_mib": (fwd_bwd_peak - before) / 2**20,
                "total_peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    ticks.append(time.perf_counter())
    return {"fwd_bwd_s": ticks[1] - ticks[0], "optimizer_s": ticks[2] - ticks[1], "held_mib": None,
            "activation_peak_mib": None, "total_peak_mib": None}


def _one(layout: str, item: dict, timed: bool, model, optimizer, runs: dict, recorders: dict, settings: dict,
         ctx: Context) -> None:
    """One step of ``layout`` on round ``item`` (kept when ``timed``); a failure is recorded and ends the layout."""
    from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION

    run = runs.setdefault(layout, {"steps": [], "error": None})
    if run["error"]:
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION if layout.startswith("packed") else "sdpa")
    micro = [_device_batch(b, ctx.device, settings["dtype"]) for b in item["packed" if layout.startswith("packed")
                                                                          else layout]]
    row = {"layout": layout}
    with recorded(row, ctx.device), recorders[layout].active(record=not timed):
        step = _step(model, optimizer, micro, ctx)
        if timed:
            run["steps"].append({**step, "round": item["round"]})
    if "error" in row:
        optimizer.zero_grad(set_to_none=True)
        run["error"] = row["error"]
    release(ctx.device)


def measure_model(kind: str, ctx: Context, settings: dict, save) -> dict:
    from vlm_pack import enable_packing

    rng = np.random.default_rng(0)
    model = shapes.build(kind, ctx.dry, ctx.device, settings["dtype"])
    params = sum(p.numel() for p in model.parameters())
    enable_packing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ctx.cuda)
    batches = _batches(kind, ctx, settings, rng, model)
    recorders = {"packed": AttentionRecorder(), "padded": AttentionRecorder(), "padded+mask": AttentionRecorder()}
    peak_tflops, gpu = bf16_peak_tflops(ctx.device)
    result = {"model": kind, "parameters": params, "gpu": gpu, "bf16_peak_tflops": peak_tflops, "layouts": {}}
    runs: dict[str, dict] = {}
    layouts = ["packed", *PADDED]
    for r, item in enumerate(batches):
        if r == 1 and " repeated " in recorders["packed"].summary():
            alt = f"packed via {alternative_route(ctx)}"  # auto repeats KV heads: time a route that does not
            recorders[alt] = AttentionRecorder(force=alternative_route(ctx))
            layouts.insert(1, alt)
            _one(alt, batches[0], False, model, optimizer, runs, recorders, settings, ctx)  # its warm-up
        order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
        for layout in order:
            _one(layout, item, r > 0, model, optimizer, runs, recorders, settings, ctx)
        save(result | {"partial_runs": {k: {"error": v["error"], "steps": len(v["steps"])} for k, v in runs.items()}})
    for layout in layouts:
        run = runs[layout]
        steps = run["steps"]
        rounds = [s["round"] for s in steps]
        real = np.array([sum(batches[i]["lengths"]) for i in rounds], dtype=float)
        flops = np.array([shapes.step_flops(model, batches[i]["lengths"], batches[i]["patches"]) for i in rounds])
        source = "packed" if layout.startswith("packed") else "padded"
        entry = {"error": run["error"], "attention": recorders[layout].summary(), "timed_steps": len(steps),
                 "slots": float(np.mean([b["slots"][source] for b in batches[1:]])),
                 "micro_batches": float(np.mean([len(b[source if source == "packed" else "padded"])
                                                 for b in batches[1:]]))}
        if steps:
            fwd_bwd = np.array([s["fwd_bwd_s"] for s in steps])
            total = fwd_bwd + np.array([s["optimizer_s"] for s in steps])
            entry.update(
                fwd_bwd_s=float(np.median(fwd_bwd)), optimizer_s=float(np.median([s["optimizer_s"] for s in steps])),
                tokens_per_s=float(np.median(real / fwd_bwd)), step_tokens_per_s=float(np.median(real / total)),
                mfu=None if peak_tflops is None else float(np.median(flops / fwd_bwd)) / (peak_tflops * 1e12),
                held_mib=steps[0]["held_mib"],
                activation_peak_mib=None if steps[0]["activation_peak_mib"] is None
                else float(max(s["activation_peak_mib"] for s in steps)),
                total_peak_mib=None if steps[0]["total_peak_mib"] is None
                else float(max(s["total_peak_mib"] for s in steps)))
        result["layouts"][layout] = entry
    timed = batches[1:]
    result["real_tokens_per_step"] = float(np.mean([sum(b["lengths"]) for b in timed]))
    result["samples_per_step"] = float(np.mean([len(b["lengths"]) for b in timed]))
    result["longest_sample"] = int(max(max(b["lengths"]) for b in timed))
    result["slot_ratio_padded_over_packed"] = float(np.mean([b["slots"]["padded"] / b["slots"]["packed"]
                                                             for b in timed]))
    best = max((e.get("tokens_per_s", 0.0), name) for name, e in result["layouts"].items() if name.startswith("packed"))
    result["best_packed"] = best[1]
    for layout in PADDED:
        other = result["layouts"][layout]
        if best[0] and "tokens_per_s" in other:
            result[f"speedup_over_{layout}"] = best[0] / other["tokens_per_s"]
    del model, optimizer, batches
    release(ctx.device)
    return result


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    settings = _settings(ctx)
    results: list[dict] = []
    for kind in ("qwen2_vl", "text"):
        entry = {"model": kind}
        with recorded(entry, ctx.device):
            entry = measure_model(kind, ctx, settings, lambda partial: ctx.save({"models": results + [partial]}))
        results.append(entry)
        ctx.save({"models": results})
    checks = {f"{r['model']} measured": "error" not in r for r in results}
    checks.update({f"{r['model']}/{layout} ran": not e["error"] for r in results
                   for layout, e in r.get("layouts", {}).items()})
    return Result(_markdown(results, settings, ctx), {"models": results, "goal_packed_over_padded": GOAL}, checks)


def _markdown(results: list[dict], settings: dict, ctx: Context) -> list[str]:
    done = [r for r in results if "layouts" in r]
    gpu = done[0] if done else {"gpu": "n/a", "bf16_peak_tflops": None}
    lines = [f"One optimiser step (forward + the model's loss + backward, then AdamW), "
             f"{str(settings['dtype']).replace('torch.', '')}, activation checkpointing, micro-batches of a "
             f"{settings['budget']}-token budget of real ShareGPT lengths clipped to {settings['cap']} (padded: the "
             f"same samples in micro-batches of at most {settings['budget']} slots, gradients accumulated), "
             f"{settings['rounds']} timed round(s) after a warm-up, layouts interleaved. Timed with "
             f"{'CUDA events' if ctx.cuda else 'the wall clock'}: fwd + bwd apart from the optimiser step; real "
             "tokens / s and MFU on fwd + bwd. Activation peak: the fwd + bwd peak minus what the step started "
             f"with. GPU: {gpu['gpu']} (bf16 peak {fmt(gpu['bf16_peak_tflops'], '.0f')} TFLOP/s).", ""]
    lines += [f"{r['model']}: failed: {r['error']}" for r in results if "error" in r]
    rows = []
    for r in done:
        for layout, e in r["layouts"].items():
            rows.append([f"{r['model']} ({r['parameters'] / 1e9:.2f}B)", layout, fmt(e["slots"], ".0f"),
                         fmt(e["micro_batches"], ".1f"), e["error"] or fmt(e.get("fwd_bwd_s"), ".3f"),
                         fmt(e.get("optimizer_s"), ".3f"), fmt(e.get("tokens_per_s"), ".0f"), fmt(e.get("mfu"), ".1%"),
                         fmt(e.get("activation_peak_mib"), ".0f"), fmt(e.get("total_peak_mib"), ".0f")])
    lines += table(["model", "layout", "slots / step", "micro-batches", "fwd+bwd s", "AdamW s", "real tokens / s",
                    "MFU", "activation peak MiB", "total peak MiB"], rows)
    lines += ["", "Attention per layout (what ran in its warm-up step, calls counted, activation recompute included: route or "
              "SDPA backend, GQA):", ""]
    lines += [f"- {r['model']} / {layout}: {e['attention']}" for r in done for layout, e in r["layouts"].items()]
    lines += [""]
    for r in done:
        lines.append(f"{r['model']}: {r['samples_per_step']:.1f} samples / step (longest {r['longest_sample']}), "
                     f"{r['real_tokens_per_step']:.0f} real tokens; best packed ({r['best_packed']}) / padded "
                     f"{fmt(r.get('speedup_over_padded'))}x, / padded+mask {fmt(r.get('speedup_over_padded+mask'))}x;"
                     f" ideal (padded slots / packed slots) {r['slot_ratio_padded_over_packed']:.2f}x")
    vlm = next((r for r in done if r["model"] == "qwen2_vl"), None)
    if vlm is not None and not ctx.dry:
        got = vlm.get("speedup_over_padded")
        lines.append(f"Goal: packed / padded >= {GOAL:g}x real tokens / s on the VLM mix at the 2B shape: "
                     + ("not measured" if got is None else f"{got:.2f}x, {'met' if got >= GOAL else 'NOT met'}"))
    return lines
