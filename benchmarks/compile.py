"""``torch.compile`` of a packed model on CPU: recompiles over 20 batches and compiled vs eager step time.

A tiny Qwen3 (2 layers, ``enable_packing``) trains on 20 packed rows of different sample counts and lengths:

* ``fixed``: every row packed to the same width (``pad_to_length``; the slack is one trailing fill segment);
* ``variable``: rows as long as their samples (no ``pad_to_length``).

Every recompile is logged with dynamo's guard-failure reason and attributed to vlm_pack when the failing guard
names an input vlm_pack supplies (``cu_seq_lens_*``, ``max_length_*``) or a vlm_pack source line. Step time
(forward + backward, fp32) is then measured with eager and compiled steps interleaved over the same rows
(median per step), after every shape has been compiled.

``--flex``: compiled FlexAttention alone (CPU, static shapes) over 20 fixed-width rows of different segment
layouts and two layer kinds: recompiles per batch (the block mask's ``mask_mod`` is a fresh closure per batch).

Run: ``python benchmarks/compile.py [--quick] [--flex]``; writes ``benchmarks/results/compile_cpu.md`` (+ ``.json``)
or ``compile_flex_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch

from vlm_pack import pack_batch_sequences
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_models import tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
VLM_PACK_INPUTS = ("cu_seq_lens", "max_length_", "vlm_pack/")


class RecompileLog(logging.Handler):
    """Collects dynamo's recompile messages (``torch._logging.set_logs(recompiles=True)``)."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message:
            self.reasons.append(message)


def rows(count: int, width: int | None, seed: int = 0) -> list[dict]:
    """``count`` packed rows of 2..6 samples (lengths below 192 / count: a fixed-width row always ends with a
    fill segment), padded to ``width`` or as long as the samples (``width=None``)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(2, 7, (1,), generator=generator))
        lengths = torch.randint(1, 192 // n, (n,), generator=generator)
        ids = torch.randint(1, 512, (n, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        packed = pack_batch_sequences(ids, attention_mask=mask, pad_to_length=width)
        out.append({"input_ids": packed.tokens, "position_ids": packed.position_ids, **packed.attention_kwargs()})
    return out


def step(model, row) -> None:
    model.zero_grad(set_to_none=True)
    model(**row, use_cache=False).logits.logsumexp(-1).mean().backward()


def run(mode: str, batches: int, rounds: int, backend: str, device: str = "cpu") -> dict:
    """``device="cuda"``: the same on a GPU (benchmarks/gpu/recompiles.py), steps timed with a sync."""
    torch._dynamo.reset()
    model = enable_packing(tiny_model("qwen3", layers=2, vocab_size=512)).to(device).train()
    compiled = torch.compile(model, backend=backend)
    data = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in row.items()}
            for row in rows(batches, 192 if mode == "fixed" else None)]
    log = RecompileLog()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(log)
    torch._logging.set_logs(recompiles=True)
    first_compile = None
    after_first = []
    try:
        for i, row in enumerate(data):
            before = len(log.reasons)
            start = time.perf_counter()
            step(compiled, row)
            if i == 0:
                first_compile = time.perf_counter() - start
            else:
                after_first.append(len(log.reasons) - before)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(log)
    ours = [r for r in log.reasons if any(key in r for key in VLM_PACK_INPUTS)]
    eager_times, compiled_times = [], []
    for _ in range(rounds):
        for row in data:
            for fn, times in ((model, eager_times), (compiled, compiled_times)):
                start = time.perf_counter()
                step(fn, row)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
    eager, comp = statistics.median(eager_times), statistics.median(compiled_times)
    return {
        "mode": mode, "batches": batches, "widths": sorted({r["input_ids"].shape[1] for r in data}),
        "first_compile_s": round(first_compile, 1), "recompiles": len(log.reasons), "recompiles_vlm_pack": len(ours),
        "recompiles_per_batch_after_first": after_first,
        "reasons": [r.split("triggered by the following guard failure(s):")[-1].strip()[:300] for r in log.reasons],
        "eager_step_ms": round(eager * 1e3, 2), "compiled_step_ms": round(comp * 1e3, 2),
        "compiled_over_eager": round(comp / eager, 3),
    }


def flex_recompiles(batches: int, width: int = 256) -> dict:
    """Compiled FlexAttention (CPU: static shapes) over ``batches`` fixed-width rows of different segment layouts,
    two layer kinds (causal, causal with a 32-token window): recompiles per kind after its first call."""
    import numpy as np

    from vlm_pack.attention.varlen import varlen_attention

    torch._dynamo.reset()
    log = RecompileLog()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(log)
    torch._logging.set_logs(recompiles=True)
    rng = np.random.default_rng(0)
    q = k = v = torch.randn(width, 2, 16)
    per_batch, start = [], time.perf_counter()
    try:
        for _ in range(batches):
            cuts = np.sort(rng.choice(np.arange(1, width), size=int(rng.integers(1, 8)), replace=False))
            cu = torch.tensor([0, *cuts.tolist(), width], dtype=torch.int32)
            before = len(log.reasons)
            with torch.no_grad():
                for window in (None, (32, 0)):
                    varlen_attention(q, k, v, cu, cu, None, None, window=window, backend="flex")
            per_batch.append(len(log.reasons) - before)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(log)
    return {"batches": batches, "width": width, "recompiles_per_batch": per_batch,
            "seconds": round(time.perf_counter() - start, 1),
            "reasons": [r.split("triggered by the following guard failure(s):")[-1].strip()[:300] for r in log.reasons]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 batches, 1 timing round, fixed width only")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--flex", action="store_true",
                        help="only compiled FlexAttention's recompiles (writes compile_flex_cpu.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.flex:
        flex = flex_recompiles(6 if args.quick else 20)
        text = "\n".join([
            "# Compiled FlexAttention on CPU: recompiles per batch", "",
            f"{flex['batches']} rows of {flex['width']} tokens, 2-8 segments each (random cuts), two layer kinds per "
            "row (causal; causal with a 32-token window), torch " + torch.__version__ + ", static shapes (CPU). "
            "`python benchmarks/compile.py --flex`.", "",
            f"Recompiles per batch: {flex['recompiles_per_batch']} ({flex['seconds']} s in all).", "",
            "Reasons:", "", *(f"- {reason}" for reason in flex["reasons"]), ""])
        if not args.quick:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "compile_flex_cpu.md").write_text(text)
        print(text)
        return
    batches, rounds = (6, 1) if args.quick else (20, 3)
    modes = ["fixed"] if args.quick else ["fixed", "variable"]
    results = [run(mode, batches, rounds, args.backend) for mode in modes]
    meta = {"torch": torch.__version__, "backend": args.backend, "cpu": platform.processor() or platform.machine(),
            "threads": 1}
    lines = [
        "# torch.compile of a packed model (CPU)", "",
        f"tiny Qwen3 (2 layers, enable_packing), fp32 forward + backward, {meta['threads']} thread, torch "
        f"{meta['torch']}, backend {args.backend}. `python benchmarks/compile.py`.", "",
        "| rows | widths | first compile (s) | recompiles (all / vlm_pack) | recompiles per batch after the first |"
        " eager step (ms) | compiled step (ms) | compiled / eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        widths = r["widths"] if len(r["widths"]) <= 3 else f"{len(r['widths'])} widths"
        lines.append(f"| {r['mode']} | {widths} | {r['first_compile_s']} | {r['recompiles']} / "
                     f"{r['recompiles_vlm_pack']} | {r['recompiles_per_batch_after_first']} | {r['eager_step_ms']} | "
                     f"{r['compiled_step_ms']} | {r['compiled_over_eager']} |")
    lines += ["", "Recompile reasons (dynamo's failing guards):", ""]
    for r in results:
        lines += [f"- {r['mode']}: {reason}" for reason in r["reasons"]]
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "compile_cpu.md").write_text("\n".join(lines) + "\n")
        (RESULTS / "compile_cpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
