"""Stage b: kernels. Every varlen attention route available here, forward + backward in bf16 on packed rows of
real ShareGPT lengths (GQA at Qwen2-VL-2B's head layout): max abs error of the output and of the q / k / v
gradients against an fp64 reference computed per sample with plain math (SDPA, or the scores written out), not
vlm_pack's code. In order of value, each route and each measurement recording its own failure:

1. ``packed``: causal segments, every route;
2. speed at two row lengths, every route (CUDA events, repeated until a stated spread), with each route's first
   call (its compile) timed apart; the image layout through flex as one more row;
3. ``window``: causal with a sliding window (torch_varlen's ``window_size``, flex, sdpa_segments, flash_attn);
4. ``blocks+window+softcap``: Gemma-style bidirectional image blocks inside causal attention, a sliding window and
   attention-logit softcapping at once (the routes that express all three: flex, sdpa_segments);
5. ``shared_prefix`` (preference pairs / GRPO groups: a segment that also sees another one's prefix, Tq != Tk);
6. ``pytest -m gpu`` with what is left of the box.

A route passes when its error is at most ``NOISE_FACTOR`` x the error of the reference's own computation run in
bf16 on the same rows (bf16's own rounding, independent of vlm_pack's code). A route that repeats the KV heads
(torch_varlen on a torch whose ``varlen_attn`` has no ``enable_gqa``) is named with the factor.
"""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.attention import useful_flops
from benchmarks.gpu.common import (ROOT, Context, Result, draw_lengths, error_text, fmt, recorded, require_cuda,
                                   synchronize, table, timed_repeats)
from vlm_pack.attention.shared_prefix import shared_prefix_keys
from vlm_pack.attention.varlen import available_backends, varlen_attention

NOISE_FACTOR = 4.0
BASELINE = "plain per-sample math (bf16)"  # the bound: the reference's own computation, in bf16
PYTEST_BUDGET_S = 45  # `pytest -m gpu` runs last, with at most this much of what is left
SPEED_RESERVE_S = 6  # a speed measurement is not started with less left (flex compiles on its first call)
CUDA_ROUTES = ("flash_attn", "transformer_engine", "torch_varlen", "flex", "sdpa_segments")
SOFTCAP = 5.0  # scores of unit-variance q, k reach +-3: a cap of 5 changes them visibly
IMAGE_LAYOUT = "blocks+window+softcap"


def _shapes(ctx: Context) -> dict:
    if ctx.dry:
        return {"heads": 4, "kv_heads": 2, "head_dim": 16, "error_row": 192, "cap": 64, "speed_rows": (256,),
                "window": 16, "image_block": 12, "timing": {"min_repeats": 3, "max_seconds": 0.5}}
    return {"heads": 12, "kv_heads": 2, "head_dim": 128, "error_row": 8192, "cap": 4096,
            "speed_rows": (16384, 65536), "window": 1024, "image_block": 256,
            "timing": {"min_repeats": 10, "max_seconds": 2.0, "target_spread": 0.05}}


@functools.lru_cache(maxsize=None)
def kv_repeat(route: str, heads: int, kv_heads: int) -> int:
    """How many times the route copies each KV head to reach the query heads (1: native GQA). Read from torch's own
    ``varlen_attn`` signature, not from vlm_pack."""
    if route != "torch_varlen" or heads == kv_heads:
        return 1
    from torch.nn.attention.varlen import varlen_attn

    return 1 if "enable_gqa" in inspect.signature(varlen_attn).parameters else heads // kv_heads


def _routes(ctx: Context) -> tuple[list[str], dict[str, str]]:
    status = available_backends()
    routes, notes = [], {}
    for name in CUDA_ROUTES:
        if not status[name].available:
            notes[name] = status[name].reason
        elif ctx.dry and name != "sdpa_segments":
            notes[name] = "not run in the dry run (CPU: no flex backward, compile cost)"
        else:
            routes.append(name)
    if "flash_attn" not in routes:
        notes["flash_attn"] = notes.get("flash_attn", "") + " (PyPI has no flash-attn binary wheel: not measured)"
    return routes, notes


def _layout_routes(layout: str, routes: list[str]) -> list[str]:
    status = available_backends()
    if layout == IMAGE_LAYOUT:
        return [r for r in routes if status[r].image_blocks and status[r].softcap]
    return [r for r in routes if not (layout == "window" and r == "transformer_engine")]


def _pair_prefixes(lengths: list[int]) -> list[tuple[int, int]]:
    """Every odd segment also sees the first half of the segment before it (a prompt shared by two answers)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(int(starts[s - 1]), max(1, lengths[s - 1] // 2)) if s % 2 else (0, 0) for s in range(len(lengths))]


def _image_blocks(lengths: list[int], size: int) -> torch.Tensor:
    """``[T]`` block ids: in every second segment one image of ``size`` tokens starting at its 3rd token, its own id;
    -1 elsewhere."""
    ids = []
    for s, n in enumerate(lengths):
        seg = [-1] * n
        if s % 2 == 0 and n > 4:
            for i in range(2, min(n, 2 + size)):
                seg[i] = s
        ids += seg
    return torch.tensor(ids)


def _reference(q, k, v, grad, lengths, prefixes, dtype=torch.float64, window=None, blocks=None, softcap=None):
    """Per-sample causal attention in ``dtype`` (kv heads repeated) on each segment's own keys: its prefix then
    itself (bottom-right causal alignment, the prefix's query rows dropped). With ``window`` / ``blocks`` /
    ``softcap`` the scores are written out: ``allowed(i, j) = (j <= i or block[i] == block[j] >= 0) and
    j >= i - window + 1``, scores ``softcap * tanh(s / softcap)``. In fp64 the exact reference; in bf16 its error is
    bf16's own rounding on these rows (the bound)."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    outs = []
    for s, n in enumerate(lengths):
        own = torch.arange(starts[s], starts[s] + n, device=q.device)
        pre = torch.arange(prefixes[s][0], prefixes[s][0] + prefixes[s][1], device=q.device)
        index = torch.cat([pre, own])

        def heads(x, repeat):
            return x.index_select(0, index).transpose(0, 1)[None].repeat_interleave(repeat, dim=1)

        qs, ks, vs = heads(q, 1), heads(k, group), heads(v, group)
        if window is None and blocks is None and softcap is None:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        else:
            i = torch.arange(len(index), device=q.device)
            allowed = i[None, :] <= i[:, None]
            if blocks is not None:
                b = blocks.to(q.device).index_select(0, index)
                allowed |= (b[:, None] == b[None, :]) & (b[:, None] >= 0)
            if window is not None:
                allowed &= i[None, :] >= i[:, None] - (window - 1)
            scores = (qs @ ks.transpose(-1, -2)) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(dtype) @ vs
        outs.append(out[0].transpose(0, 1)[-n:])
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    return out.detach(), grads


def _gaps(out, grads, reference) -> dict:
    want_out, want_grads = reference
    return {"out": (out.double() - want_out).abs().max().item(),
            **{f"d{n}": (g.double() - w).abs().max().item() for n, g, w in zip("qkv", grads, want_grads)}}


def _options(layout: str, shapes: dict, blocks: torch.Tensor, device: str) -> dict:
    """varlen_attention keywords of a layout (the window as (left, 0): ``window`` keys including the query's own)."""
    window = (shapes["window"] - 1, 0)
    if layout == "window":
        return {"window": window}
    if layout == IMAGE_LAYOUT:
        return {"window": window, "block_ids": blocks.to(device), "softcap": SOFTCAP}
    return {}


def _errors(route: str, q, k, v, grad, lengths, prefixes, reference, options=None) -> dict:
    """Max abs errors of one route (and the seconds of its first call on this layout: compile included)."""
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=q.device)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    synchronize(q.device.type)
    start = time.perf_counter()
    if any(size for _, size in prefixes):
        layout = shared_prefix_keys(lengths, prefixes)
        index = layout["key_index"].to(q.device)
        keys, values = leaves[1].index_select(0, index), leaves[2].index_select(0, index)
        out = varlen_attention(leaves[0], keys, values, cu, layout["cu_seqlens_k"].to(q.device), max(lengths),
                               layout["max_length_k"], backend=route)
    else:
        out = varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), backend=route, **(options or {}))
    gaps = _gaps(out, torch.autograd.grad(out, leaves, grad), reference)
    synchronize(q.device.type)
    return {**gaps, "first_call_s": time.perf_counter() - start}


def _speed(route: str, total: int, shapes: dict, ctx: Context, rng: np.random.Generator, layout: str) -> dict:
    lengths = draw_lengths(rng, total, cap=total // 2)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=ctx.device)
    q = torch.randn(total, shapes["heads"], shapes["head_dim"], device=ctx.device, dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(total, shapes["kv_heads"], shapes["head_dim"], device=ctx.device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    options = _options(layout, shapes, _image_blocks(lengths, shapes["image_block"]), ctx.device)

    def step():
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend=route, **options)
        torch.autograd.grad(out, (q, k, v), grad)

    synchronize(ctx.device)
    start = time.perf_counter()
    step()  # first call: flex compiles here (dynamic shapes: a later row length may compile once more)
    synchronize(ctx.device)
    first = time.perf_counter() - start
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    timing = timed_repeats(step, ctx.device, **shapes["timing"])
    flops = 3 * useful_flops(lengths, shapes["heads"], shapes["head_dim"])
    return {"first_call_s": first, "segments": len(lengths), "longest": max(lengths), **timing,
            "useful_tflops": flops / (timing["ms"] / 1e3) / 1e12,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if ctx.cuda else None}


def _gpu_tests(ctx: Context) -> dict:
    if ctx.dry:
        return {"status": "not run in the dry run (every gpu-marked test skips without CUDA)"}
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    timeout = min(PYTEST_BUDGET_S, ctx.seconds_left() - 5)
    if timeout < 10:
        return {"status": f"not run: {ctx.seconds_left():.0f} s left in the box", "files": files}
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "-o", f"faulthandler_timeout={max(5, int(timeout) - 3)}", *files]
    try:
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        print((expired.stdout or b"")[-6000:], (expired.stderr or b"")[-3000:], flush=True)
        return {"status": f"timed out after {timeout:.0f} s", "files": files}
    print(run.stdout[-6000:], run.stderr[-3000:], flush=True)
    summary = [line for line in run.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return {"status": f"exit code {run.returncode}", "summary": summary[-1] if summary else run.stdout[-300:],
            "files": files, "returncode": run.returncode,
            "failures": [line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:20]}


def _error_layout(layout, routes, q, k, v, grad, lengths, prefixes, shapes, blocks, data, ctx) -> None:
    """One layout's rows: the bf16 bound, then each route (a failing route gets its error, the next one runs)."""
    kwargs = {}
    if layout in ("window", IMAGE_LAYOUT):
        kwargs["window"] = shapes["window"]
    if layout == IMAGE_LAYOUT:
        kwargs.update(blocks=blocks, softcap=SOFTCAP)
    base = {"layout": layout, "route": BASELINE}
    with recorded(base, ctx.device):
        reference = _reference(q, k, v, grad, lengths, prefixes, **kwargs)
        base.update(_gaps(*_reference(q, k, v, grad, lengths, prefixes, torch.bfloat16, **kwargs), reference))
    data["errors"].append(base)
    ctx.save(data)
    if "error" in base:
        return
    for route in _layout_routes(layout, routes):
        row = {"layout": layout, "route": route, "kv_repeat": kv_repeat(route, q.shape[1], k.shape[1])}
        with recorded(row, ctx.device):
            row.update(_errors(route, q, k, v, grad, lengths, prefixes, reference,
                               _options(layout, shapes, blocks, ctx.device)))
        data["errors"].append(row)
        ctx.save(data)


def _speed_rows(routes: list[str], shapes: dict, ctx: Context, data: dict, notes: dict) -> None:
    rng = np.random.default_rng(1)
    plan = [(route, total, "packed") for total in shapes["speed_rows"] for route in routes]
    plan += [(route, shapes["speed_rows"][0], IMAGE_LAYOUT) for route in _layout_routes(IMAGE_LAYOUT, routes)
             if route == "flex" or ctx.dry]
    for route, total, layout in plan:
        if ctx.seconds_left() < SPEED_RESERVE_S:
            notes[f"{route} {layout} at T={total}"] = "speed not measured: the stage's time box ran out"
            continue
        row = {"route": route, "layout": layout, "T": total,
               "kv_repeat": kv_repeat(route, shapes["heads"], shapes["kv_heads"])}
        with recorded(row, ctx.device):
            row.update(_speed(route, total, shapes, ctx, rng, layout))
        data["speed"].append(row)
        ctx.save(data)


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    shapes = _shapes(ctx)
    routes, notes = _routes(ctx)
    rng = np.random.default_rng(0)
    data: dict = {"shapes": dict(shapes), "routes": routes, "not_run": notes, "errors": [], "speed": [],
                  "softcap": SOFTCAP}
    lengths = draw_lengths(rng, shapes["error_row"], shapes["cap"])
    total = sum(lengths)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q = torch.randn(total, shapes["heads"], shapes["head_dim"], device=ctx.device, generator=gen).bfloat16()
    k, v = (torch.randn(total, shapes["kv_heads"], shapes["head_dim"], device=ctx.device, generator=gen).bfloat16()
            for _ in range(2))
    grad = torch.randn(q.shape, device=ctx.device, generator=gen).bfloat16()
    plain = [(0, 0)] * len(lengths)
    blocks = _image_blocks(lengths, shapes["image_block"])
    common = (q, k, v, grad, lengths)
    _error_layout("packed", routes, *common, plain, shapes, blocks, data, ctx)
    _speed_rows(routes, shapes, ctx, data, notes)
    for layout in ("window", IMAGE_LAYOUT):
        _error_layout(layout, routes, *common, plain, shapes, blocks, data, ctx)
    _error_layout("shared_prefix", routes, *common, _pair_prefixes(lengths), shapes, blocks, data, ctx)
    try:
        data["pytest_gpu"] = _gpu_tests(ctx)
    except Exception as error:  # noqa: BLE001 - recorded
        data["pytest_gpu"] = {"status": f"failed to run: {error_text(error)}"}
    ctx.save(data)
    checks = _checks(data)  # first: it writes each row's worst / plain bf16 ratio that the table shows
    return Result(_markdown(data, shapes, total, len(lengths)), data, checks)


def _checks(data: dict) -> dict[str, bool]:
    checks = {}
    for layout in dict.fromkeys(r["layout"] for r in data["errors"]):
        rows = [r for r in data["errors"] if r["layout"] == layout]
        base = next(r for r in rows if r["route"] == BASELINE)
        if "error" in base:
            checks[f"{layout}: the reference ran"] = False
            continue
        for r in rows:
            if r is base:
                continue
            if "error" in r:
                checks[f"{layout}/{r['route']} ran"] = False
                continue
            r["worst_over_baseline"] = max(r[key] / max(base[key], 1e-30) for key in ("out", "dq", "dk", "dv"))
            checks[f"{layout}/{r['route']} within {NOISE_FACTOR:g}x plain bf16 math's error"] = (
                r["worst_over_baseline"] <= NOISE_FACTOR)
    for r in data["speed"]:
        if "error" in r:
            checks[f"speed {r['layout']}/{r['route']} at T={r['T']} ran"] = False
    if "returncode" in data["pytest_gpu"]:
        checks["pytest -m gpu passed"] = data["pytest_gpu"]["returncode"] == 0
    return checks


def _markdown(data: dict, shapes: dict, total: int, segments: int) -> list[str]:
    def kv(r):
        return "native GQA" if r.get("kv_repeat", 1) == 1 else f"KV heads repeated {r['kv_repeat']}x"

    lines = [f"bf16 forward + backward, {shapes['heads']} query / {shapes['kv_heads']} kv heads, head dim "
             f"{shapes['head_dim']}, causal. Error row: {total} tokens, {segments} real ShareGPT lengths (clipped "
             f"to {shapes['cap']}), vs fp64 per-sample math. window: {shapes['window']} keys; {IMAGE_LAYOUT}: one "
             f"{shapes['image_block']}-token bidirectional image block in every second segment + the window + "
             f"softcap {SOFTCAP:g}; shared_prefix: every second segment also sees the first half of the one before "
             "it. First call s: forward + backward including any compile (flex).", ""]
    lines += table(["layout", "route", "GQA", "max abs err out", "dq", "dk", "dv", "worst / plain bf16", "first call s"],
                   [[r["layout"], r["route"], kv(r) if r["route"] != BASELINE else "",
                     *((r["error"], "", "", "", "") if "error" in r else
                       (fmt(r["out"], ".1e"), fmt(r["dq"], ".1e"), fmt(r["dk"], ".1e"), fmt(r["dv"], ".1e"),
                        fmt(r.get("worst_over_baseline"), ".2f"))), fmt(r.get("first_call_s"), ".1f")]
                    for r in data["errors"]])
    lines += ["", "Speed (useful TFLOP/s: in-segment causal work, fwd + bwd = 3x forward; ms: median of CUDA-event "
              "timed calls, repeated until the interquartile range is within 5% of the median or 2 s; first call "
              "s: the route's first call at this shape, compile included):", ""]
    lines += table(["route", "layout", "GQA", "T", "segments", "longest", "ms", "IQR / median", "repeats",
                    "useful TFLOP/s", "peak MiB", "first call s"],
                   [[r["route"], r["layout"], kv(r), r["T"], *((r["error"], "", "", "", "", "", "", "")
                     if "error" in r else (r["segments"], r["longest"], fmt(r["ms"]), fmt(r["spread"], ".1%"),
                                           r["repeats"], fmt(r["useful_tflops"], ".1f"), fmt(r["peak_mib"], ".0f"),
                                           fmt(r["first_call_s"], ".1f")))] for r in data["speed"]])
    notes = data["not_run"]
    lines += ["", "Not run: " + ("; ".join(f"{name}: {why}" for name, why in notes.items()) or "none"), "",
              f"`pytest -m gpu`: {data['pytest_gpu']['status']}"
              + (f" - {data['pytest_gpu']['summary']}" if "summary" in data["pytest_gpu"] else "")]
    lines += [f"    {line}" for line in data["pytest_gpu"].get("failures", [])]
    return lines
