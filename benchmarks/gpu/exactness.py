"""Stage c: exactness on the device. Tiny Qwen2-VL (photos + text chats through ``VLMPackingCollator``) and tiny
Llama (random ids), ONE packed forward through ``enable_packing`` vs each sample ALONE through the stock model
(``attn_implementation="sdpa"``, same weights).

* fp32: within the CPU suite's bound (tests/tolerance.py: ``NOISE_FACTOR`` x the fp32 noise floor measured on
  the same samples against the stock model in fp64, TF32 off);
* bf16: the packed-vs-alone gap within ``BF16_FACTOR`` x bf16's own batched-vs-alone noise, measured here: the
  stock model on the same samples as one right-padded batch vs each alone (floored at one bf16 ulp of the
  largest logit).
"""

from __future__ import annotations

import copy
import sys

import torch

from benchmarks.gpu.common import ROOT, Context, Result, error_text, fmt, release, require, require_cuda, table
from vlm_pack.attention.varlen import select_backend

BF16_FACTOR = 4.0
BF16_EPS = torch.finfo(torch.bfloat16).eps


def _tolerance():
    sys.path.insert(0, str(ROOT / "tests"))
    import tolerance

    return tolerance


def _to(batch: dict, device: str, dtype: torch.dtype | None = None) -> dict:
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            value = value.to(device)
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
        out[key] = value
    return out


def _forward(model, batch: dict) -> torch.Tensor:
    from vlm_pack import model_inputs

    with torch.no_grad():
        return model(**model_inputs(batch), use_cache=False).logits.float()


def _qwen2_vl_case():
    """(stock fp32 model, packed batch, [alone batches], padded batch of all, real segment slices)."""
    from vlm_pack import VLMPackingCollator
    from vlm_pack.core.batch import packing_metadata
    from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_model

    data = require("vlm_pack.testing.data", "scikit-image / easy-vqa")
    processor = offline_qwen2vl_processor()
    vlm = tiny_model("qwen2_vl")
    examples = data.photo_examples(3, seed=1) + data.text_chat_examples(2, seed=1)
    packed = VLMPackingCollator(processor, max_length=4096, model_config=vlm.config)
    padded = VLMPackingCollator(processor, max_length=4096, model_config=vlm.config, pack_sequences_in_batch=False)
    batch = packed(examples)
    meta = packing_metadata(batch)
    slices = list(zip(meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist()))
    return vlm, batch, [padded([e]) for e in examples], padded(examples), slices


def _llama_case():
    from vlm_pack import pack_sequences
    from vlm_pack.testing.tiny_models import tiny_model

    llama = tiny_model("llama", vocab_size=512)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 512, (n,), generator=generator) for n in (37, 200, 3, 129, 64)]
    row = pack_sequences(ids)
    batch = {"input_ids": row.tokens, "position_ids": row.position_ids, **row.attention_kwargs()}
    alone = [{"input_ids": x[None]} for x in ids]
    tokens = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
    slices = list(zip(row.cu_seqlens_padded[:-1].tolist(), row.seq_lengths.tolist()))
    return llama, batch, alone, {"input_ids": tokens, "attention_mask": mask}, slices


CASES = (("qwen2_vl", _qwen2_vl_case), ("llama", _llama_case))


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    tol = _tolerance()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows, checks = [], {}
    for name, build in CASES:  # a failing model is recorded and the next one runs
        try:
            row = _measure(name, *build(), ctx, tol)
        except Exception as error:  # noqa: BLE001 - recorded, never hidden
            import traceback

            traceback.print_exc()
            rows.append({"model": name, "error": error_text(error)})
            checks[f"{name} ran"] = False
            release(ctx.device)
            continue
        rows.append(row)
        checks[f"{name} fp32 packed within {tol.NOISE_FACTOR:g}x fp32 noise floor"] = row["fp32_err"] <= row["fp32_tolerance"]
        checks[f"{name} bf16 packed within {BF16_FACTOR:g}x bf16 batched-vs-alone noise"] = (
            row["bf16_err"] <= row["bf16_bound"])
        ctx.save({"rows": rows})
    ok = [r for r in rows if "error" not in r]
    lines = [f"Packed forward (enable_packing; fp32 -> `{select_backend(ctx.device, torch.float32)}`, bf16 -> "
             f"`{select_backend(ctx.device, torch.bfloat16)}`) vs each sample alone through the stock sdpa model, "
             "max abs logit error over the real tokens.", ""]
    lines += [f"{r['model']}: FAILED {r['error']}" for r in rows if "error" in r]
    lines += table(["model", "samples", "tokens", "fp32 err", "fp32 bound (16x floor)", "bf16 err",
                    "bf16 batched-vs-alone noise", f"bf16 bound ({BF16_FACTOR:g}x max(noise, ulp))"],
                   [[r["model"], r["samples"], r["tokens"], fmt(r["fp32_err"], ".1e"), fmt(r["fp32_tolerance"], ".1e"),
                     fmt(r["bf16_err"], ".1e"), fmt(r["bf16_batched_noise"], ".1e"), fmt(r["bf16_bound"], ".1e")]
                    for r in ok])
    return Result(lines, {"rows": rows}, checks)


def _measure(name, stock, packed_batch, alone, batched, slices, ctx: Context, tol) -> dict:
    """One model's fp32 and bf16 packed-vs-alone errors and their bounds."""
    from vlm_pack import enable_packing

    stock = stock.to(ctx.device)
    packed = enable_packing(copy.deepcopy(stock))
    # fp32 vs the stock model alone; the floor from the same stock model in fp64
    floor = tol.NoiseFloor(f"{name} logits")
    exact = tol.fp64_copy(stock)
    want = [_forward(stock, _to(b, ctx.device))[0] for b in alone]
    for w, b in zip(want, alone):
        floor.observe(w, _forward(exact, _to(b, ctx.device, torch.float64))[0])
    del exact
    got = _forward(packed, _to(packed_batch, ctx.device))[0]
    fp32_err = max(tol.max_abs(got[s:s + n], w[:n]) for (s, n), w in zip(slices, want))
    # bf16: packed vs alone, beside the stock model's own batched-vs-alone gap
    stock16, packed16 = stock.bfloat16(), packed.bfloat16()
    want16 = [_forward(stock16, _to(b, ctx.device, torch.bfloat16))[0] for b in alone]
    got16 = _forward(packed16, _to(packed_batch, ctx.device, torch.bfloat16))[0]
    rows16 = _forward(stock16, _to(batched, ctx.device, torch.bfloat16))
    bf16_err = max(tol.max_abs(got16[s:s + n], w[:n]) for (s, n), w in zip(slices, want16))
    noise = max(tol.max_abs(rows16[i, :n], w[:n]) for i, ((_, n), w) in enumerate(zip(slices, want16)))
    ulp = BF16_EPS * max(w.abs().max().item() for w in want16)
    row = {"model": name, "samples": len(slices), "tokens": sum(n for _, n in slices),
           "fp32_err": fp32_err, "fp32_floor": floor.value, "fp32_tolerance": floor.tolerance,
           "bf16_err": bf16_err, "bf16_batched_noise": noise, "bf16_ulp": ulp,
           "bf16_bound": BF16_FACTOR * max(noise, ulp), "bf16_backend": select_backend(ctx.device, torch.bfloat16),
           "fp32_backend": select_backend(ctx.device, torch.float32)}
    return row
