"""Long packed rows with Qwen's real vocabulary: peak memory and step time of every training path, chunked vs full logits.

A tiny Qwen2 (hidden 64, 2 layers) with the real vocabulary (V = 151,936) trains one packed row of T tokens (samples of
1024 tokens, every slot a target but the sample starts: the worst case for a loss that scores target slots only),
fp32 on CPU, one thread. Each path runs what its trainer runs per micro-batch:

* ``trainer``: ``Trainer(model=enable_packing(model))``: ``model(**batch).loss.backward()`` (labels in the batch);
* ``compute_loss_func``: ``Trainer(compute_loss_func=vlm_pack.compute_loss_func)``: the forward without labels,
  then ``compute_loss_func(outputs, labels, num_items_in_batch)``;
* ``offline_packs``: the same over the row ``PackedDataset.collate`` builds itself (the offline in-memory recipe's
  batches, their own ``batch["vlm_pack"]``: issue 45; before it they carried none and held 3.02x the logits);
* ``sft``: ``PackedSFTTrainer`` (TRL's fused LM head in vlm_pack's tiles, ``vlm_pack.integrations.fused_tiles``,
  as the trainer's step runs it): ``model(**batch, fused_lm_head=True)``, loss from log-probs;
* ``dpo``: ``PackedDPOTrainer``: the policy's fused forward with ``shift_labels`` (gradient) and the reference
  model's (no gradient) on the row of chosen / rejected sequences, the sigmoid DPO loss over sequence sums;
* ``grpo``: ``PackedGRPOTrainer``'s loss forward: the policy's fused forward with ``shift_labels``, token-level
  clipped-ratio loss with the old log-probs detached (one iteration per generation);
* ``sp2``: Ulysses SP = 2 (``benchmarks/sequence_parallel.py``'s launch: each rank's slice, loss as UlyssesTrainer).

``loss``: ``chunked`` is vlm_pack's default (``enable_packing``: the LM head in chunks at target slots); ``full`` is
``enable_packing(model, chunked_loss=False)``, the model's own loss over ``T x V`` logits, run only where it fits
(``--full-max``; three ``T x V`` fp32 tensors must fit the machine), its computed size given beside the rest.
Every configuration is a fresh process (peak RSS is a process-lifetime figure): peak = peak RSS during the steps
minus the RSS before the first step (model, optimizer-free, batch already built), and the median time of the steps
after the first (a warm-up that still counts for the peak). TRL's fused head (``sft``, ``dpo``, ``grpo``) scores
every slot on CPU; in its own ``[4096, 32,768]`` tiles it held about two ``T x V`` tensors (1.85x at T = 2048,
``--trl-tiles`` runs them so), in the tiles vlm_pack's trainers set a small fraction; those paths run up to
``--fused-max``. Lengths
are the outer loop and each full-logits run follows its chunked twin (interleaved), so load drifts hit both alike.
Run: ``python benchmarks/long_rows.py``; writes ``benchmarks/results/long_rows_cpu.md`` (``--name`` another name).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sequence_parallel  # noqa: E402  (the SP = 2 launch, same vocabulary and row)

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = sequence_parallel.VOCAB
SAMPLE = sequence_parallel.SAMPLE
PATHS = ("trainer", "compute_loss_func", "offline_packs", "sft", "dpo", "grpo", "sp2")
FULL_PATHS = ("trainer", "compute_loss_func")
FUSED_PATHS = ("sft", "dpo", "grpo")  # TRL's fused LM head: 32,768-token chunks, so one chunk per row here
GiB = 2**30


def logits_bytes(length: int) -> int:
    return length * VOCAB * 4


def build(path: str, loss: str):
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from vlm_pack import enable_packing
    from vlm_pack.testing.tiny_models import tiny_model

    model = enable_packing(tiny_model("qwen2", layers=2, vocab_size=VOCAB), chunked_loss=loss == "chunked")
    model.train()
    reference = None
    if path in ("sft", "dpo", "grpo"):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1") if path == "sft" else ("log_probs",))
    if path == "dpo":
        reference = enable_packing(tiny_model("qwen2", layers=2, vocab_size=VOCAB, seed=1))
        add_fused_lm_head(reference)
        reference.eval().requires_grad_(False)
    torch.manual_seed(0)
    return model, reference


def offline_row(length: int) -> dict:
    """The row of :func:`sequence_parallel.packed_row`'s samples as ``PackedDataset.collate`` builds it (its own
    bookkeeping entry, nothing added here)."""
    from types import SimpleNamespace

    from datasets import Dataset

    from vlm_pack.offline.dataset import PackedDataset

    ids = sequence_parallel.packed_row(length)["input_ids"][0]
    samples = [chunk.tolist() for chunk in ids.split(SAMPLE)]
    packs = PackedDataset(Dataset.from_dict({"input_ids": samples}), SimpleNamespace(pad_token_id=0), SAMPLE)
    return packs.collate([packs[i] for i in range(len(packs))])


def step(path: str, model, reference, batch, trl_tiles: bool = False) -> None:
    import contextlib

    from vlm_pack.integrations.fused_tiles import fused_tiles

    with contextlib.nullcontext() if trl_tiles else fused_tiles():
        _step(path, model, reference, batch)


def _step(path: str, model, reference, batch) -> None:
    import torch
    import torch.nn.functional as F

    import vlm_pack

    labels = batch["labels"]
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    if path == "trainer":
        model(**batch).loss.backward()
    elif path in ("compute_loss_func", "offline_packs"):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        vlm_pack.compute_loss_func(model(**inputs), labels, (targets != -100).sum()).backward()
    elif path == "sft":
        out = model(**batch, fused_lm_head=True)
        (-out.log_probs.sum() / out.label_mask.sum()).backward()
    else:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs, shift_labels=targets, fused_lm_head=True)
        if path == "grpo":
            ratio = torch.exp(out.log_probs - out.log_probs.detach())
            advantages = torch.linspace(-1, 1, ratio.shape[-1])[None]
            loss = -(torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) * out.label_mask).sum()
            (loss / out.label_mask.sum()).backward()
        else:  # dpo: sequences 2k (chosen) and 2k+1 (rejected)
            with torch.no_grad():
                ref = reference(**inputs, shift_labels=targets, fused_lm_head=True).log_probs
            cu = batch["cu_seq_lens_q"].long()
            seg = torch.searchsorted(cu[1:], torch.arange(labels.shape[-1]), right=True)
            sums = torch.zeros(cu.numel() - 1).index_add(0, seg, (out.log_probs - ref)[0])
            margin = sums[0::2] - sums[1::2]
            (-F.logsigmoid(0.1 * margin).mean()).backward()


def worker(path: str, length: int, loss: str, steps: int, output: str, trl_tiles: bool = False) -> None:
    import torch

    torch.set_num_threads(1)
    if path == "offline_packs":
        batch = offline_row(length)
    else:
        batch = sequence_parallel.packed_row(length)
        batch["vlm_pack"] = {"cu_seqlens_padded": batch["cu_seq_lens_q"]}  # the collator's bookkeeping entry
    model, reference = build(path, loss)
    before = sequence_parallel.rss_mb()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(path, model, reference, batch, trl_tiles)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    timed = sorted(times[1:] or times)  # the first step warms up (it still counts for the peak)
    Path(output).write_text(json.dumps({"peak_mb": peak - before, "step_s": timed[len(timed) // 2], "times": times}))


def paired_worker(path: str, length: int, rounds: int, output: str) -> None:
    """Step-time ratio chunked / full in ONE process: both models built, their steps alternating (the order
    swapped every round), after one warm-up step each; on a busy machine this pairs each step with a neighbour."""
    import torch

    torch.set_num_threads(1)
    batch = sequence_parallel.packed_row(length)
    batch["vlm_pack"] = {"cu_seqlens_padded": batch["cu_seq_lens_q"]}
    models = {loss: build(path, loss) for loss in ("chunked", "full")}
    times: dict[str, list[float]] = {"chunked": [], "full": []}
    for round_ in range(rounds + 1):
        for loss in ("chunked", "full") if round_ % 2 == 0 else ("full", "chunked"):
            model, reference = models[loss]
            start = time.perf_counter()
            step(path, model, reference, batch)
            model.zero_grad(set_to_none=True)
            if round_:  # round 0 warms both up
                times[loss].append(time.perf_counter() - start)
    ratios = sorted(c / f for c, f in zip(times["chunked"], times["full"]))
    Path(output).write_text(json.dumps({"ratios": ratios, "median": ratios[len(ratios) // 2], **times}))


def launch(path: str, length: int, loss: str, steps: int, trl_tiles: bool = False) -> dict:
    if path == "sp2":
        return sequence_parallel.launch(length, 2, steps)
    with tempfile.TemporaryDirectory() as scratch:
        output = os.path.join(scratch, "result.json")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--path", path, "--length",
                   str(length), "--loss", loss, "--steps", str(steps), "--output", output,
                   *(["--trl-tiles"] if trl_tiles else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{path} T={length} {loss} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        return json.loads(Path(output).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (the first included)")
    parser.add_argument("--long-steps", type=int, default=2, help="steps at T >= 16384")
    parser.add_argument("--full-max", type=int, default=4096, help="longest row for the full-logits runs")
    parser.add_argument("--fused-max", type=int, default=4096, help="longest row for TRL's fused-head paths")
    parser.add_argument("--sp-max", type=int, default=32768, help="longest row for the SP = 2 path")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--length", type=int)
    parser.add_argument("--loss")
    parser.add_argument("--output")
    parser.add_argument("--trl-tiles", action="store_true", help="TRL's own fused-head tiles (not vlm_pack's)")
    parser.add_argument("--name", default="long_rows_cpu", help="results file name (without .md / .json)")
    parser.add_argument("--render", help="rewrite the table from a results JSON of an earlier run (same arguments)")
    parser.add_argument("--paired", type=int, default=0,
                        help="instead: ROUNDS of chunked / full steps alternating in one process per path, at "
                             "the first length (the step-time ratio on a busy machine)")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        results = {tuple(int(x) if x.isdigit() else x for x in key.split("|")): value
                   for key, value in saved["results"].items()}
        write(results, args, saved["loads"])
        return
    if args.worker:
        if args.paired:
            paired_worker(args.path, args.length, args.paired, args.output)
        else:
            worker(args.path, args.length, args.loss, args.steps, args.output, args.trl_tiles)
        return
    if args.paired:
        paired(args)
        return
    results, loads = {}, []
    for path, length, loss in plan(args):
        steps = args.steps if length < 16384 else args.long_steps
        loads.append(os.getloadavg()[0])
        results[path, length, loss] = launch(path, length, loss, steps, args.trl_tiles)
        print(f"T={length} {path} {loss}: {results[path, length, loss]}", flush=True)
        write(results, args, loads)  # after every configuration: a stopped run keeps what it measured


def paired(args) -> None:
    """Run :func:`paired_worker` for the full-logits paths; write ``long_rows_paired_cpu.md``."""
    length, lines = args.lengths[0], []
    load = os.getloadavg()[0]
    for path in (p for p in FULL_PATHS if p in args.paths):
        with tempfile.TemporaryDirectory() as scratch:
            output = os.path.join(scratch, "paired.json")
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--paired", str(args.paired),
                       "--path", path, "--length", str(length), "--output", output]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"paired {path} failed:\n{(done.stdout + done.stderr)[-3000:]}")
            got = json.loads(Path(output).read_text())
        print(path, got, flush=True)
        lines.append(f"| {path} | **{got['median']:.2f}x** | {', '.join(f'{r:.2f}' for r in got['ratios'])} | "
                     f"{sum(got['chunked']) / len(got['chunked']):.1f} / {sum(got['full']) / len(got['full']):.1f} |")
    header = [
        f"# Long rows: chunked vs full-logits step time, paired in one process (T = {length}, V = {VOCAB:,}, CPU)",
        "",
        f"`python benchmarks/long_rows.py --lengths {length} --paired {args.paired}`: per path, one process builds "
        "both models (vlm_pack's chunked loss and `chunked_loss=False`), warms each up with one step, then "
        f"alternates their steps for {args.paired} rounds (order swapped every round); ratio = chunked / full per "
        f"round. Load average (1 min) at the start: {load:.1f} on 2 shared cores (other jobs running).",
        "",
        "| path | median ratio | per round | mean step chunked / full (s) |",
        "|---|---|---|---|",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_rows_paired_cpu.md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(header + lines))


def plan(args) -> list[tuple[str, int, str]]:
    """The acceptance paths first (each full-logits run right after its chunked twin: interleaved), then SP = 2,
    then TRL's fused-head paths, each over the lengths in order."""
    configs = []
    for length in args.lengths:
        for path in (p for p in FULL_PATHS if p in args.paths):
            configs.append((path, length, "chunked"))
            if length <= args.full_max:
                configs.append((path, length, "full"))
        if "offline_packs" in args.paths:
            configs.append(("offline_packs", length, "chunked"))
    if "sp2" in args.paths:
        configs += [("sp2", length, "chunked") for length in args.lengths if length <= args.sp_max]
    for length in args.lengths:
        configs += [(path, length, "chunked") for path in FUSED_PATHS if path in args.paths and length <= args.fused_max]
    return configs


def write(results: dict, args, loads: list[float]) -> None:
    import torch
    import transformers
    import trl

    lengths = args.lengths
    lines = [
        "# Long packed rows, real vocabulary (V = 151,936): peak memory and step time per training path (CPU)",
        "",
        f"Tiny Qwen2 (hidden 64, 2 layers) with Qwen's vocabulary, one packed row of samples of {SAMPLE} tokens (every "
        "slot a target but the sample starts), fp32, 1 thread, forward + backward as each trainer runs it per "
        "micro-batch (benchmarks/long_rows.py docstring). Peak = peak RSS during the steps minus RSS before them "
        f"(fresh process per configuration); time = median of the steps after a warm-up step ({args.steps} steps; "
        f"{args.long_steps} at T >= 16384, where a single step is timed with its warm-up). `chunked` = vlm_pack's "
        "default loss from hidden states; `full` = `enable_packing(model, chunked_loss=False)` (the model's own loss "
        "over T x V logits), run up "
        f"to T = {args.full_max}. {platform.machine()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, TRL {trl.__version__}. Load average (1 min) during the runs: "
        f"{min(loads):.1f}-{max(loads):.1f} on 2 shared cores (other jobs running): times are indicative.",
        "",
        f"Command: `python benchmarks/long_rows.py --lengths {' '.join(map(str, lengths))} --steps {args.steps} "
        f"--long-steps {args.long_steps} --full-max {args.full_max} --fused-max {args.fused_max} --sp-max "
        f"{args.sp_max} --paths {' '.join(args.paths)}{' --trl-tiles' if args.trl_tiles else ''} --name {args.name}` "
        "(the defaults add T = 8192 and 16384 and more steps; cut here to fit the shared machine's "
        "time and its 24 GiB).",
        "",
        "## Peak memory over baseline (MiB), and as a multiple of the row's logits (T x V fp32)",
        "",
        "| path | " + " | ".join(f"T={t}" for t in lengths) + " |",
        "|---|" + "---|" * len(lengths),
        "| logits size (T x V fp32) | " + " | ".join(f"{logits_bytes(t) / 2**20:.0f}" for t in lengths) + " |",
    ]

    def cell(path: str, length: int, loss: str) -> str:
        got = results.get((path, length, loss))
        if got is None:
            return "-"
        return f"{got['peak_mb']:.0f} ({got['peak_mb'] * 2**20 / logits_bytes(length):.2f}x)"

    for path in args.paths:
        if path in FUSED_PATHS:  # TRL's fused head on CPU scores every slot
            lines.append(f"| {path} | " + " | ".join(cell(path, t, "chunked") if (path, t, "chunked") in results
                                                     else f"not run (~{2 * logits_bytes(t) / GiB:.1f} GiB)"
                                                     for t in lengths) + " |")
            continue
        if path == "sp2":
            lines.append("| sp2 (per rank) | " + " | ".join(cell(path, t, "chunked") if (path, t, "chunked") in results
                                                           else "not run (time)" for t in lengths) + " |")
            continue
        lines.append(f"| {path} | " + " | ".join(cell(path, t, "chunked") for t in lengths) + " |")
        if path in FULL_PATHS:
            full = []
            for t in lengths:
                if (path, t, "full") in results:
                    full.append(cell(path, t, "full"))
                else:  # three T x V fp32 tensors (logits, log-softmax, their gradient): 3.03x measured at 4096
                    full.append(f"not run (~{3 * logits_bytes(t) / GiB:.1f} GiB)")
            lines.append(f"| {path}, full logits | " + " | ".join(full) + " |")
    lines += ["", "## Step time (s, median)", "",
              "| path | " + " | ".join(f"T={t}" for t in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for path in args.paths:
        for loss in ("chunked", "full") if path in FULL_PATHS else ("chunked",):
            label = path if loss == "chunked" else f"{path}, full logits"
            lines.append(f"| {label} | " + " | ".join(
                f"{results[path, t, loss]['step_s']:.2f}" if (path, t, loss) in results else "-" for t in lengths) + " |")
    tiles = "TRL's own [4096, 32768]" if args.trl_tiles else "vlm_pack's [1024, 4096] (the Packed*Trainer steps')"
    lines += ["", f"TRL's fused head (sft, dpo, grpo) ran in {tiles} tiles.", "", "## Acceptance (issues 37, 45)", ""]
    for path in (*FULL_PATHS, "offline_packs", *FUSED_PATHS):
        if (path, 4096, "chunked") in results:
            ratio = results[path, 4096, "chunked"]["peak_mb"] * 2**20 / logits_bytes(4096)
            lines.append(f"- {path} at T = 4096: peak **{ratio:.3f}x** the logits' size (<= 0.2x: "
                         f"{'met' if ratio <= 0.2 else 'NOT met'}).")
        if (path, 32768, "chunked") in results:
            peak = results[path, 32768, "chunked"]["peak_mb"] / 1024
            lines.append(f"- {path} at T = 32768: peak **{peak:.2f} GiB** over the model (< 6 GiB: "
                         f"{'met' if peak < 6 else 'NOT met'}).")
        if (path, 2048, "full") in results:
            ratio = results[path, 2048, "chunked"]["step_s"] / results[path, 2048, "full"]["step_s"]
            lines.append(f"- {path} at T = 2048: chunked step {ratio:.2f}x the full-logits step in separate processes "
                         "(swings with the load; the acceptance figure, <= 1.25x, is the paired one in "
                         "[long_rows_paired_cpu.md](long_rows_paired_cpu.md)).")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    saved = {"results": {f"{p}|{t}|{l}": v for (p, t, l), v in results.items()}, "loads": loads}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(saved, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
