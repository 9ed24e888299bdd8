"""Hybrid linear-attention model (Qwen3.5) on CPU: packed vs padded training steps, and the per-segment path's cost.

Two measurements, each as A/B pairs interleaved in one run (median of the paired ratios, with the 25th-75th
percentile spread), fp32, one intra-op thread:

1. Training step (forward + loss + backward) of a tiny Qwen3.5 text model (hidden 64; Gated DeltaNet and full
   attention alternating; 5000-token vocabulary) on micro-batches of long-tailed (lognormal) sample lengths:
   ``packed`` (one row, ``enable_packing``: varlen attention + per-sample DeltaNet) vs ``padded`` (the stock sdpa
   model on the same samples right-padded to the longest, with an attention mask). Rate = real tokens / s.
2. One DeltaNet layer's sequence mixing (causal conv + chunked gated delta rule, forward + backward) on a packed
   row: ``segments`` (our exact torch path, ``vlm_pack.attention.gated_deltanet``) vs ``per_sample``
   (transformers' reference functions run on each sample alone: the unpacked reference on the same tokens) and vs
   ``whole_row`` (the same functions on the whole row, ignoring the boundaries: wrong, but the least work).

Run: ``python benchmarks/linear_attention.py [--quick]``; writes ``benchmarks/results/linear_attention_cpu.md``.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vlm_pack import pack_batch_sequences
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.attention.gated_deltanet import segmented_gated_delta_rule
from vlm_pack.attention.linear import packed_layout, segmented_causal_conv1d
from vlm_pack.testing.tiny_models import tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 5000


def lengths_for(batch: int, longest: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(longest / 6), 0.9, size=batch).astype(int), 8, longest).tolist()


def paired(a: Callable[[], None], b: Callable[[], None], rounds: int) -> tuple[float, float, np.ndarray]:
    """Median seconds of ``a`` and ``b`` and the per-round ratios ``b / a``, calls interleaved (warm-up first)."""
    a(), b()
    ta, tb = [], []
    for i in range(rounds):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ta, tb = np.array(ta), np.array(tb)
    return float(np.median(ta)), float(np.median(tb)), tb / ta


def spread(ratios: np.ndarray) -> str:
    low, mid, high = np.percentile(ratios, [25, 50, 75])
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


# ------------------------------------------------------------------ 1. training steps


def step_benchmark(batch: int, longest: int, rounds: int, seed: int) -> dict:
    packed_model = enable_packing(tiny_model("qwen3_5_text", layers=4, vocab_size=VOCAB))
    padded_model = tiny_model("qwen3_5_text", layers=4, vocab_size=VOCAB)
    lengths = lengths_for(batch, longest, seed)
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, width), generator=generator) * mask
    labels = torch.where(mask.bool(), ids, -100)
    pack = pack_batch_sequences(ids, labels, padding_mask=mask)
    shifted = torch.cat([pack.labels[0, 1:], pack.labels.new_full((1,), -100)])
    shifted[pack.cu_seqlens_padded[1:] - 1] = -100  # no target across a boundary
    n_targets = int((shifted != -100).sum())

    def packed_step():
        packed_model.zero_grad(set_to_none=True)
        logits = packed_model(input_ids=pack.tokens, position_ids=pack.position_ids, use_cache=False,
                              **pack.attention_kwargs()).logits[0]
        F.cross_entropy(logits, shifted, ignore_index=-100, reduction="sum").div(n_targets).backward()

    def padded_step():
        padded_model.zero_grad(set_to_none=True)
        logits = padded_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                        reduction="sum").div(n_targets).backward()

    t_packed, t_padded, ratios = paired(packed_step, padded_step, rounds)
    tokens = sum(lengths)
    return {"batch": batch, "tokens": tokens, "slots_padded": batch * width, "packed_ms": t_packed * 1e3,
            "padded_ms": t_padded * 1e3, "packed_tok_s": tokens / t_packed, "padded_tok_s": tokens / t_padded,
            "speedup": spread(ratios)}


# ------------------------------------------------------------------ 2. one DeltaNet layer's mixing


def mixing_benchmark(batch: int, longest: int, rounds: int, seed: int) -> dict:
    model = tiny_model("qwen3_5_text", layers=1, vocab_size=VOCAB)
    layer = model.model.layers[0].linear_attn
    namespace = sys.modules[type(layer).__module__]
    conv_ref = inspect.unwrap(namespace.causal_conv1d_fn)
    rule_ref = inspect.unwrap(namespace.torch_chunk_gated_delta_rule)
    lengths = lengths_for(batch, longest, seed)
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, layer.conv_dim, total, generator=generator, requires_grad=True)
    heads = layer.num_v_heads
    g = -torch.rand(1, total, heads, generator=generator).requires_grad_()
    beta = torch.rand(1, total, heads, generator=generator).requires_grad_()
    weight = layer.conv1d.weight.squeeze(1).detach().requires_grad_()

    def split(mixed):
        q, k, v = torch.split(mixed.transpose(1, 2), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        return (q.reshape(*q.shape[:2], -1, layer.head_k_dim), k.reshape(*k.shape[:2], -1, layer.head_k_dim),
                v.reshape(*v.shape[:2], -1, layer.head_v_dim))

    def run(conv, rule):
        mixed = conv(hidden, weight)
        out = rule(*split(mixed), g, beta)
        out.square().mean().backward()
        return out

    def segments():
        layout = packed_layout(cu, total)
        return run(lambda x, w: segmented_causal_conv1d(x, w, None, "silu", layout),
                   lambda q, k, v, g_, b: segmented_gated_delta_rule(q, k, v, g_, b, layout))

    def reference(x_slices):
        def conv(x, w):
            return torch.cat([conv_ref(x[..., s:e], w, None, activation="silu") for s, e in x_slices], dim=-1)

        def rule(q, k, v, g_, b):
            outs = [rule_ref(q[:, s:e], k[:, s:e], v[:, s:e], g=g_[:, s:e], beta=b[:, s:e],
                             use_qk_l2norm_in_kernel=True)[0] for s, e in x_slices]
            return torch.cat(outs, dim=1)

        return run(conv, rule)

    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    exact = (segments() - reference(bounds)).abs().max().item()
    t_seg, t_alone, r_alone = paired(segments, lambda: reference(bounds), rounds)
    _, t_whole, r_whole = paired(segments, lambda: reference([(0, total)]), rounds)
    return {"batch": batch, "tokens": total, "segments_ms": t_seg * 1e3, "per_sample_ms": t_alone * 1e3,
            "whole_row_ms": t_whole * 1e3, "alone_over_segments": spread(r_alone),
            "whole_over_segments": spread(r_whole), "max_diff": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, small sizes; nothing written")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 4 if args.quick else 8
    sizes = [(4, 256)] if args.quick else [(4, 512), (8, 1024), (16, 1024)]
    machine = f"CPU ({platform.machine()}), 1 intra-op thread, torch {torch.__version__}"

    steps = [step_benchmark(b, s, rounds, seed=b) for b, s in sizes]
    mixing = [mixing_benchmark(b, s, rounds, seed=b) for b, s in sizes]
    lines = [
        "# Hybrid linear-attention model (Qwen3.5) on CPU, fp32", "",
        f"Machine: {machine}. Sample lengths lognormal (median longest/6, clipped to [8, longest]). "
        f"Medians of {rounds} interleaved A/B rounds; ratios are medians of the paired ratios (25th-75th pct).", "",
        "## Training step: packed vs padded (tiny Qwen3.5 text, 4 layers, hidden 64)", "",
        "| micro-batch | real tokens | padded slots | packed ms | padded ms | packed tok/s | padded tok/s "
        "| padded / packed time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['slots_padded']} | {r['packed_ms']:.0f} | "
                     f"{r['padded_ms']:.0f} | {r['packed_tok_s']:.0f} | {r['padded_tok_s']:.0f} | {r['speedup']} |")
    lines += [
        "", "## One DeltaNet layer's mixing (conv + gated delta rule, fwd + bwd) on a packed row", "",
        "| samples | tokens | segments ms | per-sample reference ms | whole row (no boundaries) ms "
        "| per-sample / segments | whole row / segments | max diff vs per-sample |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in mixing:
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['segments_ms']:.1f} | {r['per_sample_ms']:.1f} | "
                     f"{r['whole_row_ms']:.1f} | {r['alone_over_segments']} | {r['whole_over_segments']} | "
                     f"{r['max_diff']:.1e} |")
    lines += ["", "Command: `python benchmarks/linear_attention.py`"]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / "linear_attention_cpu.md"
        out.write_text(table + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
