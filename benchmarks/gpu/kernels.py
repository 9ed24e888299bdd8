"""Stage b: kernels. Every varlen attention route available here, forward + backward in bf16 on packed rows of
real ShareGPT lengths (GQA at Qwen2-VL-2B's head layout): max abs error of the output and of the q / k / v
gradients against an fp64 reference computed per sample with plain SDPA (not our code), the shared-prefix route
(preference pairs / GRPO groups: a segment that also sees another one's prefix) against the same reference on the
explicitly concatenated sequence, ``pytest -m gpu``, then speed at two row lengths with what is left of the box.

A route passes when its error is at most ``NOISE_FACTOR`` x the error of the reference's own computation run in
bf16 (plain per-sample SDPA: bf16's own rounding on the same rows, independent of vlm_pack's code).
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.attention import useful_flops
from benchmarks.gpu.common import ROOT, Context, Result, draw_lengths, fmt, measure, require_cuda, table
from vlm_pack.attention.shared_prefix import shared_prefix_keys
from vlm_pack.attention.varlen import available_backends, varlen_attention

NOISE_FACTOR = 4.0
BASELINE = "plain SDPA per sample (bf16)"  # the bound: the reference's own computation, in bf16
PYTEST_BUDGET_S = 40  # `pytest -m gpu` runs before the speed table, which gets the rest of the box
SPEED_RESERVE_S = 8  # a speed measurement is not started with less left (flex compiles on its first call)
CUDA_ROUTES = ("flash_attn", "transformer_engine", "torch_varlen", "flex", "sdpa_segments")


def _shapes(ctx: Context) -> dict:
    if ctx.dry:
        return {"heads": 4, "kv_heads": 2, "head_dim": 16, "error_row": 192, "cap": 64, "speed_rows": (256,),
                "repeats": 1}
    return {"heads": 12, "kv_heads": 2, "head_dim": 128, "error_row": 8192, "cap": 4096,
            "speed_rows": (16384, 65536), "repeats": 3}


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


def _pair_prefixes(lengths: list[int]) -> list[tuple[int, int]]:
    """Every odd segment also sees the first half of the segment before it (a prompt shared by two answers)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(int(starts[s - 1]), max(1, lengths[s - 1] // 2)) if s % 2 else (0, 0) for s in range(len(lengths))]


def _reference(q, k, v, grad, lengths, prefixes, dtype=torch.float64):
    """Per-sample causal SDPA in ``dtype`` (kv heads repeated) on each segment's own keys: its prefix then itself;
    the prefix's query rows are computed and dropped (bottom-right causal alignment, as the packed routes use).
    In fp64 it is the exact reference; in bf16 its error is bf16's own rounding on these rows (the bound)."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    group = q.shape[1] // k.shape[1]
    outs = []
    for s, n in enumerate(lengths):
        own = torch.arange(starts[s], starts[s] + n, device=q.device)
        pre = torch.arange(prefixes[s][0], prefixes[s][0] + prefixes[s][1], device=q.device)
        index = torch.cat([pre, own])

        def heads(x, repeat):
            x = x.index_select(0, index).transpose(0, 1)[None]
            return x.repeat_interleave(repeat, dim=1)

        out = F.scaled_dot_product_attention(heads(q, 1), heads(k, group), heads(v, group), is_causal=True)
        outs.append(out[0].transpose(0, 1)[-n:])
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    return out.detach(), grads


def _gaps(out, grads, reference) -> dict:
    want_out, want_grads = reference
    return {"out": (out.double() - want_out).abs().max().item(),
            **{f"d{n}": (g.double() - w).abs().max().item() for n, g, w in zip("qkv", grads, want_grads)}}


def _errors(route: str, q, k, v, grad, lengths, prefixes, reference) -> dict:
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=q.device)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if any(size for _, size in prefixes):
        layout = shared_prefix_keys(lengths, prefixes)
        index = layout["key_index"].to(q.device)
        keys, values = leaves[1].index_select(0, index), leaves[2].index_select(0, index)
        out = varlen_attention(leaves[0], keys, values, cu, layout["cu_seqlens_k"].to(q.device), max(lengths),
                               layout["max_length_k"], backend=route)
    else:
        out = varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), backend=route)
    return _gaps(out, torch.autograd.grad(out, leaves, grad), reference)


def _speed(route: str, total: int, shapes: dict, ctx: Context, rng: np.random.Generator) -> dict:
    lengths = draw_lengths(rng, total, cap=total // 2)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=ctx.device)
    q = torch.randn(total, shapes["heads"], shapes["head_dim"], device=ctx.device, dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(total, shapes["kv_heads"], shapes["head_dim"], device=ctx.device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)

    def step():
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend=route)
        torch.autograd.grad(out, (q, k, v), grad)

    step()  # warm-up (flex compiles here)
    times = [measure(step, ctx.device) for _ in range(shapes["repeats"])]
    seconds = float(np.median([t for t, _ in times]))
    flops = 3 * useful_flops(lengths, shapes["heads"], shapes["head_dim"])
    return {"route": route, "T": total, "segments": len(lengths), "longest": max(lengths), "ms": seconds * 1e3,
            "useful_tflops": flops / seconds / 1e12, "peak_mib": times[-1][1]}


def _gpu_tests(ctx: Context) -> dict:
    if ctx.dry:
        return {"status": "not run in the dry run (every gpu-marked test skips without CUDA)"}
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    timeout = min(PYTEST_BUDGET_S, max(10.0, ctx.seconds_left() - 5))
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    try:
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s", "files": files}
    print(run.stdout[-6000:], run.stderr[-3000:], flush=True)
    summary = [line for line in run.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return {"status": f"exit code {run.returncode}", "summary": summary[-1] if summary else run.stdout[-300:],
            "files": files, "returncode": run.returncode,
            "failures": [line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:20]}


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    shapes = _shapes(ctx)
    routes, notes = _routes(ctx)
    rng = np.random.default_rng(0)
    data: dict = {"shapes": {k: v for k, v in shapes.items()}, "routes": routes, "not_run": notes, "errors": [],
                  "speed": []}
    lengths = draw_lengths(rng, shapes["error_row"], shapes["cap"])
    total = sum(lengths)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q = torch.randn(total, shapes["heads"], shapes["head_dim"], device=ctx.device, generator=gen).bfloat16()
    k, v = (torch.randn(total, shapes["kv_heads"], shapes["head_dim"], device=ctx.device, generator=gen).bfloat16()
            for _ in range(2))
    grad = torch.randn(q.shape, device=ctx.device, generator=gen).bfloat16()
    plain = [(0, 0)] * len(lengths)
    shared = _pair_prefixes(lengths)
    for layout, prefixes in (("packed", plain), ("shared_prefix", shared)):
        reference = _reference(q, k, v, grad, lengths, prefixes)
        data["errors"].append({"layout": layout, "route": BASELINE,
                               **_gaps(*_reference(q, k, v, grad, lengths, prefixes, torch.bfloat16), reference)})
        for route in routes:
            row = {"layout": layout, "route": route, **_errors(route, q, k, v, grad, lengths, prefixes, reference)}
            data["errors"].append(row)
            ctx.save(data)
        del reference
    data["pytest_gpu"] = _gpu_tests(ctx)
    ctx.save(data)
    for row_length in shapes["speed_rows"]:
        for route in routes:
            if ctx.seconds_left() < SPEED_RESERVE_S:
                notes[f"{route} at T={row_length}"] = "speed not measured: the stage's time box ran out"
                continue
            data["speed"].append(_speed(route, row_length, shapes, ctx, rng))
            ctx.save(data)

    checks = {}
    for layout in ("packed", "shared_prefix"):
        rows = [r for r in data["errors"] if r["layout"] == layout]
        base = next(r for r in rows if r["route"] == BASELINE)
        for r in rows:
            r["worst_over_baseline"] = max(r[key] / max(base[key], 1e-30) for key in ("out", "dq", "dk", "dv"))
            if r is not base:
                checks[f"{layout}/{r['route']} within {NOISE_FACTOR:g}x plain bf16 SDPA's error"] = (
                    r["worst_over_baseline"] <= NOISE_FACTOR)
    if "returncode" in data["pytest_gpu"]:
        checks["pytest -m gpu passed"] = data["pytest_gpu"]["returncode"] == 0

    lines = [f"bf16 forward + backward, {shapes['heads']} query / {shapes['kv_heads']} kv heads, head dim "
             f"{shapes['head_dim']}, causal. Error row: {total} tokens, {len(lengths)} real ShareGPT lengths (clipped "
             f"to {shapes['cap']}), vs fp64 per-sample SDPA; shared_prefix: every second segment also sees the first "
             "half of the one before it.", ""]
    lines += table(["layout", "route", "max abs err out", "dq", "dk", "dv", "worst / plain bf16 SDPA"],
                   [[r["layout"], r["route"], fmt(r["out"], ".1e"), fmt(r["dq"], ".1e"), fmt(r["dk"], ".1e"),
                     fmt(r["dv"], ".1e"), fmt(r["worst_over_baseline"], ".2f")] for r in data["errors"]])
    lines += ["", "Speed (useful TFLOP/s: in-segment causal work, fwd + bwd = 3x forward):", ""]
    lines += table(["route", "T", "segments", "longest", "ms", "useful TFLOP/s", "peak MiB"],
                   [[r["route"], r["T"], r["segments"], r["longest"], fmt(r["ms"]), fmt(r["useful_tflops"], ".1f"),
                     fmt(r["peak_mib"], ".0f")] for r in data["speed"]])
    lines += ["", "Not run: " + "; ".join(f"{name}: {why}" for name, why in notes.items()), "",
              f"`pytest -m gpu`: {data['pytest_gpu']['status']}"
              + (f" - {data['pytest_gpu']['summary']}" if "summary" in data["pytest_gpu"] else "")]
    lines += [f"    {line}" for line in data["pytest_gpu"].get("failures", [])]
    return Result(lines, data, checks)
