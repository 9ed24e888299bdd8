"""DeepSpeed ZeRO-3 on 2 CPU ranks, Qwen's real vocabulary: per-rank peak memory and step time, chunked vs full logits.

A tiny Llama (hidden 64, 2 layers, V = 151,936: the LM head is the cost real checkpoints pay) inside a DeepSpeed
ZeRO-3 engine (``deepspeed.initialize``, 2 processes, gloo, one thread each, SGD) trains one packed row of T tokens per
rank (``benchmarks/sequence_parallel.py``'s row: samples of 1024 tokens, every slot a target but the sample starts):
``engine(**batch)`` with labels, ``engine.backward(loss)``, ``engine.step()``, as ``Trainer`` does.

* ``chunked``: ``enable_packing(model)`` (vlm_pack's default): the loss from the final hidden states inside the
  forward, the partitioned head read once per loss (``vlm_pack.core.zero3``), in chunks at target slots;
* ``full``: ``enable_packing(model, chunked_loss=False)``: the model's own loss over the ``T x V`` logits (what
  ZeRO-3 runs got before).

Paired and interleaved: every round runs chunked then full at each T, each configuration a fresh 2-process launch
(peak RSS is a process-lifetime figure): peak = peak RSS during the steps minus the RSS before the first one (engine
built, batch ready), the larger of the two ranks; the median step time of the steps after the first. The step-1 loss
of both is printed beside them (the same number). Run: ``python benchmarks/zero3_loss.py [--lengths 1024 2048]``;
writes ``benchmarks/results/zero3_loss_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sequence_parallel import SAMPLE, VOCAB, packed_row, rss_mb, run_ranks  # noqa: E402  (the same row and vocabulary)

RESULTS = Path(__file__).resolve().parent / "results"
LOSSES = ("chunked", "full")


def worker(length: int, loss: str, steps: int, output: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from vlm_pack import enable_packing
    from vlm_pack.testing.tiny_models import tiny_model

    torch.set_num_threads(1)
    # DeepSpeed's CPU shared-memory all-reduce serves inference only; building it is a minutes-long C++ JIT
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    model = enable_packing(tiny_model("llama", layers=2, vocab_size=VOCAB), chunked_loss=loss == "chunked").train()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer":
              True, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                      config=config)
    batch = packed_row(length)
    before = rss_mb()
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        value = engine(**batch, use_cache=False).loss
        engine.backward(value)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(value))
        del value
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"peak_mb": peak - before, "step_s": statistics.median(times[1:] or times), "loss": losses[0],
              "head_partitioned": hasattr(dict(model.lm_head.named_parameters())["weight"], "ds_id")}
    Path(f"{output}.{dist.get_rank()}").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(length: int, loss: str, steps: int) -> dict:
    ranks = run_ranks(Path(__file__).resolve(), ["--length", str(length), "--loss", loss, "--steps", str(steps)], 2,
                      f"T={length} {loss}")
    assert all(r["head_partitioned"] for r in ranks), ranks  # ZeRO-3 really partitioned the head
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "loss": ranks[0]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--length", type=int)
    parser.add_argument("--loss", choices=LOSSES)
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.worker:
        worker(args.length, args.loss, args.steps, args.output)
        return
    runs: dict[tuple[int, str], list[dict]] = {}
    loads = []
    for round_ in range(args.rounds):
        for length in args.lengths:
            for loss in LOSSES:
                loads.append(os.getloadavg()[0])
                result = launch(length, loss, args.steps)
                runs.setdefault((length, loss), []).append(result)
                print(f"round {round_} T={length} {loss}: {result}", flush=True)
    import deepspeed
    import torch
    import transformers

    lines = [
        "# DeepSpeed ZeRO-3 (2 CPU ranks): per-rank peak memory and step time, chunked loss vs full logits",
        "",
        f"Tiny Llama (hidden 64, 2 layers, vocabulary {VOCAB}) in a ZeRO-3 engine, 2 ranks (gloo, 1 thread each), "
        f"one packed row of T tokens per rank (samples of {SAMPLE} tokens), forward with labels + backward + SGD step, "
        f"{args.steps} steps per launch, {args.rounds} rounds, chunked and full interleaved at each T, each a fresh "
        "launch. Peak = peak RSS during the steps minus RSS before them, the larger rank; step = median of the steps "
        f"after the first, the slower rank. Per cell: median over rounds (each round's value in brackets). "
        f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, deepspeed "
        f"{deepspeed.__version__}; load average during the runs {min(loads):.1f}-{max(loads):.1f} on a shared "
        "2-core machine. `python benchmarks/zero3_loss.py`.",
        "",
        "| T | one T x V fp32 (MiB) | chunked peak (MiB) | full peak (MiB) | peak chunked / full | chunked step (s) "
        "| full step (s) | step chunked / full | step-1 loss chunked / full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"

    for length in args.lengths:
        chunked, full = runs[(length, "chunked")], runs[(length, "full")]
        peaks = [c["peak_mb"] / f["peak_mb"] for c, f in zip(chunked, full)]  # paired: same round
        steps = [c["step_s"] / f["step_s"] for c, f in zip(chunked, full)]
        lines.append(
            f"| {length} | {length * VOCAB * 4 / 2**20:.0f} | {cell([c['peak_mb'] for c in chunked], 0)} "
            f"| {cell([f['peak_mb'] for f in full], 0)} | {cell(peaks, 2)}x "
            f"| {cell([c['step_s'] for c in chunked], 2)} | {cell([f['step_s'] for f in full], 2)} | {cell(steps, 2)}x "
            f"| {chunked[0]['loss']:.6f} / {full[0]['loss']:.6f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero3_loss_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
