"""Gemma 3 on CPU: packed train step vs padded train step, and the packed attention vs a dense T x T mask.

* Step: a small random Gemma 3 (2 text layers: sliding window 512, then full; SigLIP tower of one block; 64 soft
  tokens per image) does forward + backward on one micro-batch of ~4096 real tokens: long-tailed sample lengths,
  about half the samples with 1-2 images. Padded: ``[B, S_max]`` with ``attention_mask`` through the stock sdpa
  model (transformers builds a ``B x S x S`` mask with image blocks and the window). Packed: one ``[1, T]`` row
  through ``enable_packing`` (per-segment SDPA, a small mask only for segments holding an image). Both models have
  the same weights; their per-sample losses are checked equal before timing.
* Attention: the packed attention call (``varlen_attention(block_ids=...)``, per-segment SDPA) vs one SDPA call
  with a dense ``T x T`` boolean mask of the same rule, forward + backward, on the same row (T=4096, 32 heads-dim).
  The dense mask is built once outside the timed region (it would be built once per forward).

Timings are interleaved (A, B, A, B, ...); we report medians and the median of the paired ratios with its
min..max spread. Run: ``python benchmarks/gemma3.py [--quick]``; writes ``benchmarks/results/gemma3_cpu.md``.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from vlm_pack import pack_batch_sequences
from vlm_pack.attention.varlen import varlen_attention
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models.gemma3 import IMAGE_BLOCKS

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB, BOI, EOI, IMAGE = 4096, 4093, 4094, 4095
IMAGE_TOKENS, IMAGE_SIZE, WINDOW = 64, 112, 512


def make_model(packed: bool) -> Gemma3ForConditionalGeneration:
    text = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
            "attention_dropout": 0.0}
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": 14}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                          boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.02)
    return enable_packing(model) if packed else model


def make_samples(total: int, seed: int = 0) -> list[dict]:
    """Long-tailed samples summing to ``total`` tokens; about half carry 1-2 images (boi, 64 soft tokens, eoi)."""
    rng = np.random.default_rng(seed)
    samples, used = [], 0
    while used < total:
        length = int(np.clip(rng.lognormal(np.log(300), 0.8), 40, 1500))
        length = min(length, total - used)
        images = int(rng.integers(1, 3)) if rng.random() < 0.5 and length > 2 * (IMAGE_TOKENS + 2) + 8 else 0
        ids = rng.integers(10, 4000, size=length)
        types = np.zeros(length, dtype=np.int64)
        for i in range(images):
            start = 4 + i * (IMAGE_TOKENS + 4)
            ids[start] = BOI
            ids[start + 1:start + 1 + IMAGE_TOKENS] = IMAGE
            ids[start + 1 + IMAGE_TOKENS] = EOI
            types[start + 1:start + 1 + IMAGE_TOKENS] = 1
        samples.append({"ids": torch.from_numpy(ids), "types": torch.from_numpy(types), "images": images})
        used += length
    return samples


def batches(samples: list[dict]) -> tuple[dict, dict, list[int]]:
    """(padded batch, packed batch, sample lengths)."""
    lengths = [len(s["ids"]) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, :lengths[row]], types[row, :lengths[row]], mask[row, :lengths[row]] = sample["ids"], sample["types"], 1
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(sum(s["images"] for s in samples), 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = ids.masked_fill((mask == 0) | (types == 1), -100)
    padded = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "pixel_values": pixels,
              "labels": labels}
    packed_row = pack_batch_sequences(ids, labels=labels, padding_mask=mask)
    packed_types = types[mask.bool()].unsqueeze(0)
    packed = {"input_ids": packed_row.tokens, "position_ids": packed_row.position_ids,
              "token_type_ids": packed_types, "pixel_values": pixels, **packed_row.attention_kwargs()}
    return padded, {**packed, "labels": packed_row.labels}, lengths


def sample_losses(logits_rows: list[torch.Tensor], labels_rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample shifted CE sums (the loss is their sum / number of targets: identical for both layouts)."""
    return torch.stack([F.cross_entropy(lg[:-1], lb[1:], ignore_index=-100, reduction="sum")
                        for lg, lb in zip(logits_rows, labels_rows)])


def padded_step(model, batch, lengths, backward=True):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    losses = sample_losses([logits[i, :n] for i, n in enumerate(lengths)],
                           [batch["labels"][i, :n] for i, n in enumerate(lengths)])
    if backward:
        losses.sum().backward()
    return losses.detach()


def packed_step(model, batch, lengths, backward=True):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits[0]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    losses = sample_losses([logits[s:s + n] for s, n in zip(starts, lengths)],
                           [batch["labels"][0, s:s + n] for s, n in zip(starts, lengths)])
    if backward:
        losses.sum().backward()
    return losses.detach()


def interleaved(fns: dict, pairs: int) -> dict[str, list[float]]:
    """Seconds per call, A and B alternating (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(pairs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def summary(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float, float, float]:
    """(median a, median b, median ratio b/a, min ratio, max ratio) over the pairs."""
    ratios = np.asarray(times[b]) / np.asarray(times[a])
    return (float(np.median(times[a])), float(np.median(times[b])), float(np.median(ratios)),
            float(ratios.min()), float(ratios.max()))


def dense_rule_mask(lengths: list[int], block_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[T, T]`` bool: same sample AND (causal OR same image block) AND window (the packed rule, dense)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(seg.numel())
    i, j = pos[:, None], pos[None]
    allowed = (seg[:, None] == seg[None]) & ((j <= i) | ((block_ids[:, None] == block_ids[None]) & (block_ids[:, None] >= 0)))
    if window is not None:
        allowed &= j > i - window
    return allowed


def attention_bench(samples, lengths, pairs: int) -> list[str]:
    total = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    block_ids = IMAGE_BLOCKS.block_ids(torch.cat([s["types"] for s in samples])[None])[0]
    generator = torch.Generator().manual_seed(2)
    q0, k0, v0 = (torch.randn(total, h, 32, generator=generator) for h in (4, 2, 2))
    rows = []
    for name, window in (("sliding (W=512)", WINDOW), ("full", None)):
        win = None if window is None else (window - 1, window - 1)
        start = time.perf_counter()
        mask = dense_rule_mask(lengths, block_ids, window)
        build = time.perf_counter() - start
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))

        def packed_out():
            return varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), window=win, block_ids=block_ids,
                                    backend="sdpa_segments")

        def dense_out():
            return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  attn_mask=mask, enable_gqa=True).transpose(0, 1)

        def packed():
            packed_out().sum().backward()

        def dense():
            dense_out().sum().backward()

        with torch.no_grad():
            error = float((packed_out() - dense_out()).abs().max())
        times = interleaved({"packed": packed, "dense": dense}, pairs)
        a, b, ratio, low, high = summary(times, "packed", "dense")
        rows.append(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.0f} | {ratio:.2f}x ({low:.2f}-{high:.2f}) | "
                    f"{build * 1e3:.0f} | {error:.1e} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="T=1024, 2 pairs (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.pairs = 1024, 2
    torch.set_num_threads(1)
    samples = make_samples(args.tokens)
    padded, packed, lengths = batches(samples)
    padded_model, packed_model = make_model(packed=False), make_model(packed=True)

    losses_padded = padded_step(padded_model, padded, lengths, backward=False)
    losses_packed = packed_step(packed_model, packed, lengths, backward=False)
    loss_error = float(((losses_padded - losses_packed).abs() / losses_padded.abs()).max())
    times = interleaved({"packed": lambda: packed_step(packed_model, packed, lengths),
                         "padded": lambda: padded_step(padded_model, padded, lengths)}, args.pairs)
    a, b, ratio, low, high = summary(times, "packed", "padded")
    real = sum(lengths)
    slots = padded["input_ids"].numel()
    images = sum(s["images"] for s in samples)

    cpu = f"CPU ({platform.processor() or platform.machine()}, 1 thread), torch {torch.__version__}"
    lines = [
        "# Gemma 3 packed vs padded (CPU)",
        "",
        f"{cpu}; `python benchmarks/gemma3.py{' --quick' if args.quick else ''}`. Interleaved A/B, {args.pairs} "
        "pairs; ratio = median of paired ratios (min-max).",
        "",
        f"Micro-batch: {len(samples)} samples, {real} real tokens, {images} images "
        f"({images * IMAGE_TOKENS} image tokens in {images} bidirectional blocks); padded layout "
        f"{padded['input_ids'].shape[0]} x {padded['input_ids'].shape[1]} = {slots} slots "
        f"({1 - real / slots:.0%} padding). Per-sample loss agreement packed vs padded: {loss_error:.1e} (relative).",
        "",
        "## Train step (forward + backward, 2 text layers: sliding W=512 + full, hidden 128)",
        "",
        "| layout | median step (ms) | real tokens/s | padded / packed time |",
        "|---|---|---|---|",
        f"| packed [1, {real}] | {a * 1e3:.0f} | {real / a:,.0f} | |",
        f"| padded [{padded['input_ids'].shape[0]}, {padded['input_ids'].shape[1]}] | {b * 1e3:.0f} | "
        f"{real / b:,.0f} | {ratio:.2f}x ({low:.2f}-{high:.2f}) |",
        "",
        f"## Attention only (T={real}, 4 query / 2 KV heads, head dim 32, forward + backward)",
        "",
        "| layer | packed per-segment SDPA (ms) | dense T x T mask SDPA (ms) | dense / packed | dense mask build (ms) "
        "| max abs diff |",
        "|---|---|---|---|---|---|",
        *attention_bench(samples, lengths, args.pairs),
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "gemma3_cpu.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
