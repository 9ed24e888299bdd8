"""Packed attention speed: per-segment SDPA vs a block-diagonal dense mask vs FlexAttention, side by side.

A packed row of T tokens holds Zipf-distributed samples (many short, a few long). All methods compute the same
causal, boundary-respecting attention; only the useful work ``sum(L_i^2)`` matters, so TFLOP/s are reported
for useful FLOPs (``4 * H * D * sum(L_i * (L_i + 1) / 2)`` per forward).

CPU (default): fp32, forward only (FlexAttention has no CPU backward in this torch build), H=4, D=32,
T in {2k, 8k, 16k}:

* ``sdpa_segments``: ``varlen_attention(backend="sdpa_segments")``, equal lengths batched, one host sync;
* ``dense_mask``: one SDPA over the whole row with a ``[T, T]`` block-diagonal causal boolean mask;
* ``flex``: ``varlen_attention(backend="flex")``: compiled FlexAttention with our block-sparse document mask
  (compile time reported separately, it is paid once per process).

CUDA (only when a GPU is present): bf16, forward + backward, H=16, D=128: ``torch_varlen`` (and
``flash_attn`` / compiled ``flex`` where available) vs padded SDPA (samples padded to the longest, batched,
``is_causal``) vs the dense block mask.

Run: ``python benchmarks/attention.py [--quick]``; writes ``benchmarks/results/attention_cpu.md`` (and
``attention_<gpu name>.md`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vlm_pack.attention.varlen import available_backends, varlen_attention

RESULTS = Path(__file__).resolve().parent / "results"


def zipf_lengths(total: int, seed: int = 0, scale: int = 32, exponent: float = 1.6) -> list[int]:
    """Segment lengths summing to ``total``: ``scale * Zipf(exponent)`` plus uniform jitter in ``[0, scale)``,
    capped at ``total // 2`` (many short samples, a few long ones, few exact repeats)."""
    rng = np.random.default_rng(seed)
    lengths, used = [], 0
    while used < total:
        n = int(min(scale * rng.zipf(exponent) + rng.integers(scale), total // 2, total - used))
        lengths.append(n)
        used += n
    return lengths


def cu_of(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def useful_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention restricted to each segment (QK^T and PV)."""
    return 4.0 * heads * head_dim * sum(n * (n + 1) / 2 for n in lengths)


def block_diagonal_mask(lengths: list[int], device: str) -> torch.Tensor:
    """``[T, T]`` boolean mask: same segment and causal (what a packed row needs from a dense kernel)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    pos = torch.arange(seg.numel(), device=device)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def dense_mask_attention(q, k, v, mask):
    """One SDPA over the whole row with the block-diagonal mask (THD in, THD out)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask)
    return out[0].transpose(0, 1)


def padded_attention(q, k, v, lengths):
    """Pad every sample to the longest, batch them, causal SDPA (exact for right padding), unpad."""
    def pad(x):
        return torch.nn.utils.rnn.pad_sequence(torch.split(x, lengths), batch_first=True).transpose(1, 2)

    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True).transpose(1, 2)
    keep = torch.arange(out.shape[1], device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]
    return out[keep]


def timed(fn: Callable[[], torch.Tensor], repeats: int, cuda: bool) -> tuple[float, torch.Tensor]:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up; returns (seconds, last output)."""
    out = fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def cpu_rows(sizes: list[int], repeats: int, heads: int = 4, head_dim: int = 32) -> tuple[list[dict], float | None]:
    """Forward timings on CPU, the three methods interleaved round by round (the order rotating), so load on a
    shared machine hits them alike; ratios are per round. Returns the rows and the one-time flex compile seconds
    (None if flex failed)."""
    rows, flex_compile = [], None
    flex_ok = available_backends()["flex"].available
    for total in sizes:
        lengths = zipf_lengths(total)
        cu = cu_of(lengths, "cpu")
        g = torch.Generator().manual_seed(total)
        q, k, v = (torch.randn(total, heads, head_dim, generator=g) for _ in range(3))
        mask = block_diagonal_mask(lengths, "cpu")
        methods = {
            "sdpa_segments": lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths),
                                                      backend="sdpa_segments"),
            "dense_mask": lambda: dense_mask_attention(q, k, v, mask),
        }
        flex_note = ""
        with torch.no_grad():
            if flex_ok:
                try:
                    start = time.perf_counter()
                    varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="flex")
                    if flex_compile is None:
                        flex_compile = time.perf_counter() - start
                    methods["flex"] = lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths),
                                                               backend="flex")
                except Exception as exc:  # report, don't hide: the table says why flex has no number
                    flex_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            else:
                flex_note = available_backends()["flex"].reason
            outputs = {name: fn() for name, fn in methods.items()}  # warm-up, and the agreement check
            times: dict[str, list[float]] = {name: [] for name in methods}
            names = list(methods)
            for r in range(repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    start = time.perf_counter()
                    methods[name]()
                    times[name].append(time.perf_counter() - start)
        seg = np.asarray(times["sdpa_segments"])

        def ratio(name: str) -> list[float] | None:
            if name not in times:
                return None
            r = np.asarray(times[name]) / seg
            return [float(np.median(r)), float(r.min()), float(r.max())]

        rows.append({
            "T": total, "segments": len(lengths), "max_len": max(lengths), "rounds": repeats,
            "useful_gflop": useful_flops(lengths, heads, head_dim) / 1e9,
            **{f"{name}_ms": float(np.median(t)) * 1e3 for name, t in times.items()},
            "flex_ms": float(np.median(times["flex"])) * 1e3 if "flex" in times else None,
            "mask_ratio": ratio("dense_mask"), "flex_ratio": ratio("flex"),
            "max_abs_diff_mask": (outputs["dense_mask"] - outputs["sdpa_segments"]).abs().max().item(),
            "max_abs_diff_flex": (outputs["flex"] - outputs["sdpa_segments"]).abs().max().item()
            if "flex" in outputs else None,
            "flex_note": flex_note,
        })
        print(format_cpu_row(rows[-1]), flush=True)
    return rows, flex_compile


def format_cpu_row(r: dict) -> str:
    def spread(ratio: list[float] | None) -> str:
        return "n/a" if ratio is None else f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f})"

    flex = "n/a" if r["flex_ms"] is None else f"{r['flex_ms']:.1f}"
    flex_diff = "n/a" if r["max_abs_diff_flex"] is None else f"{r['max_abs_diff_flex']:.1e}"
    return (f"| {r['T']} | {r['segments']} | {r['max_len']} | {r['sdpa_segments_ms']:.1f} | {r['dense_mask_ms']:.1f} "
            f"| {flex} | {spread(r['mask_ratio'])} | {spread(r['flex_ratio'])} "
            f"| {r['useful_gflop'] / (r['sdpa_segments_ms'] / 1e3):.1f} "
            f"| {r['max_abs_diff_mask']:.1e} / {flex_diff} |")


CPU_HEADER = ("| T | segments | longest | sdpa_segments ms | dense mask ms | flex ms | mask / segments (range) "
              "| flex / segments (range) | segments useful GFLOP/s | max abs diff vs segments (mask / flex) |\n"
              "|---|---|---|---|---|---|---|---|---|---|")


def training_rows(sizes: list[int], repeats: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                  heads: int = 16, head_dim: int = 128) -> list[dict]:
    """Forward + backward timings (useful TFLOP/s count fwd + bwd as 3x the forward FLOPs)."""
    status = available_backends()
    kernels = [name for name in ("torch_varlen", "flash_attn", "flex") if status[name].available]
    if device == "cpu":  # smoke-test mode: the CUDA kernels (and flex's backward) do not run on CPU
        kernels = ["sdpa_segments"]
    cuda = device == "cuda"
    rows = []
    for total in sizes:
        lengths = zipf_lengths(total)
        cu = cu_of(lengths, device)
        q, k, v = (torch.randn(total, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        flops = 3 * useful_flops(lengths, heads, head_dim)

        def step(forward):
            def run():
                out = forward()
                torch.autograd.grad(out, (q, k, v), grad)
                return out.detach()
            return run

        methods = {name: step(lambda name=name: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths),
                                                                 backend=name)) for name in kernels}
        methods["padded_sdpa"] = step(lambda: padded_attention(q, k, v, lengths))
        if total <= 16384:  # the [T, T] mask and its score work grow quadratically
            mask = block_diagonal_mask(lengths, device)
            methods["dense_mask"] = step(lambda: dense_mask_attention(q, k, v, mask))
        row = {"T": total, "segments": len(lengths), "max_len": max(lengths)}
        reference = None
        for name, run in methods.items():
            seconds, out = timed(run, repeats, cuda=cuda)
            reference = out if reference is None else reference
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_tflops"] = flops / seconds / 1e12
            row[f"{name}_max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
        rows.append(row)
        print(row, flush=True)
    return rows


def machine() -> str:
    threads = torch.get_num_threads()
    return f"{platform.processor() or platform.machine()}, {threads} intra-op thread(s), torch {torch.__version__}"


def write_cpu(rows: list[dict], flex_compile: float | None, args) -> Path:
    lines = [
        "# Packed attention on CPU (forward, fp32)",
        "",
        f"Machine: CPU, 2 cores (shared) — {machine()}. H=4, D=32, causal, Zipf segment lengths "
        f"(32 * Zipf(1.6) + U[0, 32), capped at T/2). {args.repeats} rounds, the three methods interleaved "
        "(order rotating); times are medians, ratios the median of per-round ratios with their range. "
        f"Load average at start {args.load:.2f}.",
        "Forward only: FlexAttention has no CPU backward in this torch build.",
        "",
        CPU_HEADER,
        *[format_cpu_row(r) for r in rows],
        "",
        f"flex one-time compile (first call, T={rows[0]['T']}): "
        + ("n/a" if flex_compile is None else f"{flex_compile:.1f} s"),
    ]
    notes = {r["flex_note"] for r in rows if r["flex_note"]}
    lines += [f"flex: {n}" for n in sorted(notes)]
    flags = (" --quick" if args.quick else "") + (f" --threads {args.threads}" if args.threads != 1 else "")
    lines += ["", f"Command: `python benchmarks/attention.py{flags}`", ""]
    path = RESULTS / "attention_cpu.md"
    path.write_text("\n".join(lines))
    (RESULTS / "attention_cpu.json").write_text(json.dumps({"rows": rows, "flex_compile_s": flex_compile}, indent=1))
    return path


def write_gpu(rows: list[dict], name: str) -> Path:
    methods = sorted({key[:-3] for row in rows for key in row if key.endswith("_ms")})
    lines = [f"# Packed attention on {name} (forward + backward, bf16, H=16, D=128, causal)", "",
             "Useful TFLOP/s count only the in-segment causal work (3x forward FLOPs for fwd + bwd).", "",
             "| T | segments | longest | " + " | ".join(f"{m} ms (TFLOP/s)" for m in methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    for row in rows:
        cells = [f"{row[m + '_ms']:.2f} ({row[m + '_tflops']:.0f})" if m + "_ms" in row else "n/a" for m in methods]
        lines.append(f"| {row['T']} | {row['segments']} | {row['max_len']} | " + " | ".join(cells) + " |")
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    path = RESULTS / f"attention_{slug}.md"
    path.write_text("\n".join(lines) + "\n")
    (RESULTS / f"attention_{slug}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=2k only, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU table")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (default 1: on shared cores every OpenMP region of a busy "
                             "machine costs ~10 ms, which would swamp the many small per-segment calls)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.load = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.gpu_only:
        sizes = [2048] if args.quick else [2048, 8192, 16384]
        print(CPU_HEADER)
        rows, flex_compile = cpu_rows(sizes, args.repeats)
        print(f"wrote {write_cpu(rows, flex_compile, args)}")
    if torch.cuda.is_available():
        sizes = [8192] if args.quick else [8192, 16384, 65536]
        print(f"wrote {write_gpu(training_rows(sizes, args.repeats), torch.cuda.get_device_name())}")


if __name__ == "__main__":
    main()
