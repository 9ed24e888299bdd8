"""Sequence parallelism (DeepSpeed Ulysses, SP = 2) vs one process: per-rank peak memory and step time vs row length.

One packed row of ``L`` tokens (samples of 1024 tokens, a tiny Llama: hidden 64, 2 layers, Qwen's real vocabulary
of 151,936, so the LM head is the cost real checkpoints pay) runs forward + backward, the loss computed from the
hidden states of the rank's slice, the LM head applied in chunks at target slots (``vlm_pack.core.chunked_loss``;
the ``T x V`` logits of a 32k row alone are 18.5 GiB), inside the forward as ``UlyssesTrainer`` asks for it. No engine
here (``benchmarks/zero3_loss.py`` measures the loss inside a ZeRO-3 engine).

* SP = 1: ``enable_packing(model)`` on the whole row in one process (vlm_pack's ordinary path);
* SP = 2: two processes (gloo, one thread each), ``vlm_pack.sequence_parallel.prepare_model`` + DeepSpeed's
  ``UlyssesSPAttentionHF`` registered as accelerate does; each rank feeds its half of the row exactly as
  ``UlyssesSPDataLoaderAdapter`` slices it (the whole row in ``batch[SP_KEY]``) and computes its loss sum.
  No engine, so no gradient reduction: the step is forward + backward on one rank's share.

Each (L, SP) runs in a fresh launch (peak RSS is a process-lifetime figure): peak RSS during 3 steps minus the RSS
before the first one, per rank (the larger of the two ranks for SP = 2), and the median step time. Configurations
alternate SP = 1 / SP = 2 per length. Acceptance (issue 32): SP = 2's per-rank peak <= 0.6x SP = 1's at the
longest row. Run: ``python benchmarks/sequence_parallel.py [--lengths 4096 8192 16384 32768]``; writes
``benchmarks/results/sequence_parallel_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE = 1024
VOCAB = 151_936  # Qwen2 / Qwen2.5 / Qwen3 checkpoints' vocabulary


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def packed_row(length: int):
    import torch

    lengths = [SAMPLE] * (length // SAMPLE)
    ids = torch.randint(10, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    positions = torch.arange(SAMPLE).repeat(len(lengths))[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": SAMPLE, "max_length_k": SAMPLE}


def worker(length: int, sp: int, steps: int, output: str) -> None:
    import torch
    import torch.nn.functional as F

    from vlm_pack import enable_packing
    from vlm_pack.integrations.head_loss import TARGETS_KWARG
    from vlm_pack.sequence_parallel.batch import SP_KEY, ulysses_batch
    from vlm_pack.sequence_parallel.model import SP_ATTN_IMPLEMENTATION, SequenceShard, prepare_model
    from vlm_pack.testing.tiny_models import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("llama", layers=2, vocab_size=VOCAB)
    rank = 0
    if sp > 1:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        # DeepSpeed's CPU shared-memory all-reduce serves inference only; building it is a minutes-long C++ JIT
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_process_group("gloo")
        deepspeed.init_distributed(dist_backend="gloo")
        rank = dist.get_rank()
        prepare_model(model, sp, shard_of=lambda: SequenceShard(rank, sp))
        UlyssesSPAttentionHF.register_with_transformers(model, SP_ATTN_IMPLEMENTATION, sp, micro_batch_size=1)
    else:
        enable_packing(model)
    batch = packed_row(length)
    if sp > 1:
        row = ulysses_batch(batch, sp)
        local = length // sp
        part = slice(rank * local, (rank + 1) * local)
        shift = F.pad(row["labels"][:, 1:], (0, 1), value=-100)  # what the adapter makes of the labels
        inputs = {"input_ids": row["input_ids"][:, part], "position_ids": row["position_ids"][:, part],
                  SP_KEY: row[SP_KEY]}
        targets = shift[:, part]
    else:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    before = rss_mb()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(**inputs, use_cache=False, **{TARGETS_KWARG: targets}).loss  # this rank's summed CE
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"peak_mb": peak - before, "step_s": sorted(times)[len(times) // 2]}
    Path(f"{output}.{rank}").write_text(json.dumps(result))


def run_ranks(script: Path, arguments: list[str], ranks: int, what: str) -> list[dict]:
    """``script --worker arguments --output <scratch>`` in a fresh launch of ``ranks`` processes (torchrun when more
    than one): each rank's JSON result, rank order. A failed launch stops the benchmark naming ``what``."""
    with tempfile.TemporaryDirectory() as scratch:
        output = os.path.join(scratch, "result")
        script_args = [str(script), "--worker", *arguments, "--output", output]
        command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
                   if ranks > 1 else [sys.executable]) + script_args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{what} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        return [json.loads(Path(f"{output}.{r}").read_text()) for r in range(ranks)]


def launch(length: int, sp: int, steps: int) -> dict:
    ranks = run_ranks(Path(__file__).resolve(), ["--length", str(length), "--sp", str(sp), "--steps", str(steps)],
                      sp, f"L={length} sp={sp}")
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "step_s": max(r["step_s"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--length", type=int)
    parser.add_argument("--sp", type=int)
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.worker:
        worker(args.length, args.sp, args.steps, args.output)
        return
    rows = []
    for length in args.lengths:
        one, two = launch(length, 1, args.steps), launch(length, 2, args.steps)
        rows.append((length, one, two))
        print(f"L={length}: SP=1 {one}, SP=2 {two}", flush=True)
    import torch
    import transformers

    lines = [
        "# Sequence parallelism (DeepSpeed Ulysses) on CPU: per-rank peak memory and step time",
        "",
        f"Tiny Llama (hidden 64, 2 layers, vocabulary {VOCAB}), one packed row of samples of {SAMPLE} tokens, forward "
        f"+ backward, loss from hidden states with the LM head in chunks (as UlyssesTrainer), median of {args.steps} steps, 1 thread per rank, gloo. Peak = peak RSS during the steps minus "
        f"RSS before them, the larger rank for SP = 2. {platform.machine()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}. `python benchmarks/sequence_parallel.py --lengths "
        f"{' '.join(map(str, args.lengths))} --steps {args.steps}` (the default lengths reach 32768; these fit the "
        "time of the run on a shared 2-core machine, other jobs running: step times are indicative).",
        "",
        "| row tokens | SP=1 peak (MB) | SP=2 per-rank peak (MB) | memory ratio | SP=1 step (s) | SP=2 step (s) |",
        "|---|---|---|---|---|---|",
    ]
    for length, one, two in rows:
        ratio = two["peak_mb"] / one["peak_mb"]
        lines.append(f"| {length} | {one['peak_mb']:.0f} | {two['peak_mb']:.0f} | {ratio:.2f}x "
                     f"| {one['step_s']:.2f} | {two['step_s']:.2f} |")
    length, one, two = rows[-1]
    ratio = two["peak_mb"] / one["peak_mb"]
    lines += ["", f"At {length} tokens SP = 2's per-rank peak is **{ratio:.2f}x** SP = 1's "
              f"(acceptance <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'})."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sequence_parallel_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
