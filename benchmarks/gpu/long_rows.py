"""Stage f: long rows. Peak memory and time of forward + backward on ONE packed row of 8k and 32k tokens (real
ShareGPT lengths) at Qwen2-1.5B's shape, bf16, activation checkpointing on (how long rows are trained), through
the two SFT loss paths of the public API:

* ``model loss``: ``enable_packing(model)`` and ``model(**batch, labels=...)``: the model's own loss (what
  ``Trainer`` / ``SFTTrainer`` call; a chunked loss that never holds the full logits lands here);
* ``compute_loss_func``: ``model(**batch)`` then ``vlm_pack.compute_loss_func(outputs, labels)``.

At 32k tokens the full bf16 logits alone are 32768 x 151936 x 2 bytes = 9.3 GiB (and their fp32 upcast twice
that): the figure the long-rows work has to beat. An out-of-memory row is recorded as such.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu import shapes
from benchmarks.gpu.common import Context, Result, draw_lengths, fmt, measure, recorded, release, require_cuda, table

PATHS = ("model loss", "compute_loss_func")


def _row(length: int, vocab: int, device: str) -> dict:
    from vlm_pack import pack_sequences
    from vlm_pack.core.batch import mask_first_labels

    rng = np.random.default_rng(length)
    lengths = draw_lengths(rng, length, cap=length)
    ids = [torch.from_numpy(rng.integers(0, vocab, size=n)) for n in lengths]
    row = pack_sequences(ids, labels=ids)
    labels = mask_first_labels(row.labels.clone(), row.cu_seqlens_padded[:-1])
    batch = {"input_ids": row.tokens, "position_ids": row.position_ids, "labels": labels, **row.attention_kwargs()}
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}, len(lengths)


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    from vlm_pack import compute_loss_func, enable_packing

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    model = enable_packing(shapes.build("text", ctx.dry, ctx.device, dtype))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    rows = []
    for length in ((64, 256) if ctx.dry else (8192, 32768)):
        batch, samples = _row(length, vocab, ctx.device)
        for path in PATHS:
            def step():
                if path == "model loss":
                    loss = model(**batch).loss
                else:
                    inputs = {k: v for k, v in batch.items() if k != "labels"}
                    loss = compute_loss_func(model(**inputs), batch["labels"])
                loss.backward()
                model.zero_grad(set_to_none=True)

            entry = {"tokens": length, "samples": samples, "path": path,
                     "full_logits_mib": length * vocab * torch.finfo(dtype).bits / 8 / 2**20}
            with recorded(entry, ctx.device):  # out of memory or any other failure: recorded, the next row runs
                step()  # warm-up
                entry["seconds"], entry["peak_mib"] = measure(step, ctx.device)
            model.zero_grad(set_to_none=True)
            release(ctx.device)
            rows.append(entry)
            ctx.save({"rows": rows})
    lines = [f"One packed row, forward + backward, {str(dtype).replace('torch.', '')}, activation checkpointing, "
             f"{'tiny Qwen2' if ctx.dry else 'Qwen2-1.5B shape'} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B"
             " parameters; weights + gradients included in the peak).", ""]
    lines += table(["tokens", "samples", "loss path", "seconds", "peak MiB", "full logits MiB"],
                   [[r["tokens"], r["samples"], r["path"], r.get("error") or fmt(r.get("seconds"), ".3f"),
                     fmt(r.get("peak_mib"), ".0f"), fmt(r["full_logits_mib"], ".0f")] for r in rows])
    checks = {f"{r['tokens']} tokens / {r['path']} ran": not r.get("error") or r["error"].startswith("out of memory")
              for r in rows}
    return Result(lines, {"rows": rows}, checks)
