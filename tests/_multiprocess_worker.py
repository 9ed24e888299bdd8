"""Worker for tests/test_multiprocess.py: several 2-process checks in ONE process-group launch (gloo, CPU).

``python -m torch.distributed.run --nproc_per_node 2 tests/_multiprocess_worker.py OUT.json CASE [CASE ...]``

Each case trains (Trainer + DDP / DeepSpeed, or torch FSDP2 directly) and rank 0 writes what the test asserts:
the relative L2 error of the step-1 gradient (or weight update / learning rate, under ZeRO) against each sample
of the global batch run ALONE through the stock sdpa model with the token mean over both ranks and the whole
accumulation window (tests/test_trainer.py's references), the engine that actually ran, warnings logged, and
the samples each rank consumed. References are built after training, split between the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from datasets import Dataset  # noqa: E402
from transformers import Trainer  # noqa: E402

import test_trainer as ref  # noqa: E402  (the single-process references: each sample alone, stock sdpa)
import vlm_pack.integrations.token_mean  # noqa: E402
from vlm_pack import VLMPackingCollator  # noqa: E402
from vlm_pack.integrations.hf_model import enable_packing  # noqa: E402
from vlm_pack.offline.dataset import PackedDataset, PackedSFTDataset  # noqa: E402
from vlm_pack.offline.storage import PackedArrays, build_index, write_packed  # noqa: E402
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, qwen_tokenizer, tiny_model  # noqa: E402

WORLD = 2
COMPARE = "compare"  # a case's (reference key, its step-1 gradients, reference builder): scored later


class LogCount(logging.Handler):
    """Counts the records of one logger (the token-mean warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fresh_check() -> LogCount:
    """The token-mean check runs once per process: re-arm it for the next case and count its warnings."""
    vlm_pack.integrations.token_mean._checked = False
    counter = LogCount()
    logger = logging.getLogger("vlm_pack.integrations.token_mean")
    logger.handlers = [counter]
    logger.propagate = False
    return counter


def compare(results: dict, pending: dict) -> None:
    """The deferred comparisons: each distinct reference is built by one rank (alternating, so the two heavy
    VLM references run in parallel), which scores every case that uses it; the errors are then shared."""
    owners = {key: i % WORLD for i, key in enumerate(dict.fromkeys(key for key, _, _ in pending.values()))}
    references, errors = {}, {}
    for name, (key, grads, build) in pending.items():
        if owners[key] == dist.get_rank():
            if key not in references:
                references[key] = build()
            errors[name] = ref.relative_error(grads, references[key])
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, errors)
    for part in gathered:
        for name, error in part.items():
            results[name]["error"] = error
    pending.clear()


def trainer_grads(model, dataset, collate, out: str, **overrides) -> tuple[dict[str, torch.Tensor], Trainer]:
    """Step-1 gradients (after DDP's all-reduce) of Trainer over the 2-process group: micro-batch x 2 ranks x
    accumulation 2 covers the whole dataset in one optimizer step."""
    args = ref.training_args(out, **overrides)
    capture = ref.GradCapture()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[capture])
    trainer.train()
    return capture.grads, trainer


def engine(trainer: Trainer) -> str:
    return type(trainer.model_wrapped).__name__


# ---- DDP: the four dataset kinds ----------------------------------------------------------------------------

def vlm_case(out: str) -> dict:
    processor, tokenizer = offline_qwen2vl_processor(), qwen_tokenizer()
    proc, examples = ref.family_setup("qwen2_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    counter = fresh_check()
    grads, trainer = trainer_grads(model, examples, collator, out, per_device_train_batch_size=2)
    return {"engine": engine(trainer), "warnings": counter.messages,
            COMPARE: ("vlm", grads, lambda: ref.reference_grads("qwen2_vl", proc, examples))}


def packed_dataset_case(out: str) -> dict:
    samples = ref.random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), qwen_tokenizer(), 40)
    assert len(packs) == 4
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB))
    grads, trainer = trainer_grads(model, packs, packs.collate, out, per_device_train_batch_size=1,
                                   remove_unused_columns=True)
    return {"engine": engine(trainer), COMPARE: ("text", grads, lambda: ref.text_reference(samples))}


def sft_packs(directory: str) -> tuple[PackedSFTDataset, list, list]:
    """Four packs of three samples on disk (what `vlm-pack prepare` writes), prompt tokens masked."""
    samples = ref.random_samples()
    rng = np.random.default_rng(8)
    masks = [(np.arange(len(s)) >= rng.integers(1, len(s))).astype(np.uint8) for s in samples]
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in samples])))
    arrays = PackedArrays(index=build_index(np.array([3, 3, 3, 3]), offsets), tokens=np.concatenate(samples),
                          loss_mask=np.concatenate(masks), seq_offsets=offsets, source_index=np.arange(len(samples)))
    own = Path(directory) / f"rank{dist.get_rank()}"  # both ranks write: one directory each, no race
    path = write_packed(own / f"training_{ref.PACK}.npy", arrays)
    return PackedSFTDataset(path, ref.PACK), samples, masks


def packed_sft_case(out: str, average_tokens: bool = True) -> dict:
    packs, samples, masks = sft_packs(out)
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB))
    counter = fresh_check()
    grads, trainer = trainer_grads(model, packs, packs.collate_fn, out, per_device_train_batch_size=1,
                                   remove_unused_columns=True, average_tokens_across_devices=average_tokens)
    return {"engine": engine(trainer), "warnings": counter.messages,
            COMPARE: ("text_masked", grads, lambda: ref.text_reference(samples, masks))}


def token_budget_case(out: str) -> dict:
    from vlm_pack.budget import TokenBudgetPackDataset, measure_lengths, plan_token_budget_packs
    from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples

    processor = offline_qwen2vl_processor()
    examples = photo_examples(4, seed=3, max_side=84) + easy_vqa_examples(4, seed=3) + text_chat_examples(4, seed=3)
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    collator = VLMPackingCollator(processor, max_length=256, model_config=model.config)
    plan = plan_token_budget_packs(measure_lengths(examples, collator, progress=False), 192, data_parallel_size=WORLD)
    assert plan.num_packs == 4, plan.num_packs
    packs = TokenBudgetPackDataset(examples, plan, collator)
    grads, trainer = trainer_grads(model, packs, packs.collate_fn, out, per_device_train_batch_size=1)
    return {"engine": engine(trainer),
            COMPARE: ("token_budget", grads, lambda: ref.reference_grads("qwen2_vl", processor, examples))}


# ---- torch FSDP2 (fully_shard) directly ----------------------------------------------------------------------

def fsdp2_case(out: str) -> dict:
    """FSDP2 on a packed Llama: rank r takes packs r and r + 2 (accumulation 2); the loss denominator is the
    label-token count of all four packs (the global token mean), times the world size because FSDP averages."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vlm_pack.core.batch import model_inputs

    samples = ref.random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), qwen_tokenizer(), 40)
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    batches = [packs.collate([packs[k]]) for k in range(len(packs))]
    total = sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batches)
    for k in range(dist.get_rank(), len(packs), WORLD):
        loss = model(**model_inputs(batches[k], keep_labels=True), use_cache=False, num_items_in_batch=total).loss
        (loss * WORLD).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"engine": type(model).__name__, "sharded": sharded,
            COMPARE: ("text", grads, lambda: ref.text_reference(samples))}


# ---- DeepSpeed ZeRO through Trainer ---------------------------------------------------------------------------

def zero_case(out: str, stage: int) -> dict:
    """ZeRO hides ``.grad``: compare the weight update of one SGD step (lr 1, no momentum, no clipping) with
    -lr x the reference gradient, with Trainer's own torch SGD inside DeepSpeed. Runs last in a launch: ZeRO-3
    changes how transformers builds later models."""
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param

    # The shared-memory all-reduce kernel serves inference tensor parallelism only; building it is a C++ JIT
    # compile of minutes on a fresh machine, so DeepSpeed's gloo path is used (the probe honours this dict).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    samples = ref.random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), qwen_tokenizer(), 40)
    # Before Trainer: once ZeRO-3 is configured, transformers builds every new model partitioned (collectives).
    reference = ref.text_reference(samples)
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = ref.training_args(out, per_device_train_batch_size=1, remove_unused_columns=True, deepspeed=config,
                             learning_rate=1.0)  # a large step: the update w - w' keeps more fp32 digits
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=packs.collate)
    trainer.train()
    wrapped = trainer.model_wrapped
    after = {n: safe_get_full_fp32_param(p) for n, p in wrapped.module.named_parameters()}
    result = {"engine": type(wrapped).__name__, "stage": wrapped.zero_optimization_stage()}
    update = {n: (before[n] - after[n]) / args.learning_rate for n in reference}
    result["error"] = ref.relative_error(update, reference)
    return result


# ---- BalancedBatchSampler in Trainer ---------------------------------------------------------------------------

class Recording:
    """Collator: records the sample indices of every micro-batch it builds, then pads them for a causal LM."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, items: list[dict]) -> dict:
        self.batches.append([item["index"] for item in items])
        width = max(len(item["input_ids"]) for item in items)
        ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, :len(item["input_ids"])] = torch.as_tensor(item["input_ids"])
            mask[row, :len(item["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sampler_case(out: str) -> dict:
    """32 samples, micro-batch 2 x 2 ranks x accumulation 2: 8 micro-batches per rank and epoch, 4 optimizer
    steps. Run 1 trains 2 epochs saving at step 6 (mid epoch 1); run 2 resumes from that checkpoint."""
    from vlm_pack.integrations.sampler import BalancedBatchSampler

    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 40, 32)
    items = [{"index": i, "input_ids": rng.integers(10, ref.VOCAB, n).tolist()} for i, n in enumerate(lengths)]

    class BalancedTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return BalancedBatchSampler.for_trainer(self, lengths)

    def run(resume: str | None) -> tuple[list[list[int]], Trainer]:
        collate = Recording()
        args = ref.training_args(out, max_steps=-1, num_train_epochs=2, save_strategy="steps", save_steps=6,
                                 per_device_train_batch_size=2, save_only_model=False)
        trainer = BalancedTrainer(model=tiny_model("llama", layers=1, vocab_size=ref.VOCAB), args=args,
                                  train_dataset=items, data_collator=collate)
        trainer.train(resume_from_checkpoint=resume)
        return collate.batches, trainer

    full, trainer = run(None)
    resumed, _ = run(os.path.join(out, "checkpoint-6"))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"full": full, "resumed": resumed})
    return {"ranks": gathered, "steps": trainer.state.global_step,
            "batch_sampler": type(trainer.get_train_dataloader().batch_sampler.batch_sampler).__name__}


def stream_case(out: str) -> dict:
    """Streaming packs (vlm_pack.streaming) through Trainer: 2 ranks x 2 DataLoader workers over 8 JSONL shards of
    uneven sizes (the ranks' epochs differ in packs), accumulation 2, 9 steps (2+ epochs), a checkpoint every 3
    steps; run 2 resumes from checkpoint-6. Each rank reports every forward's samples, epoch or "pad"."""
    from datasets import load_dataset

    from vlm_pack.streaming import StreamingPackCallback, StreamingPackDataset
    from vlm_pack.testing.data import text_chat_examples

    tokenizer = qwen_tokenizer()
    examples = text_chat_examples(40, seed=11)
    cuts = [0, 2, 4, 9, 12, 20, 26, 30, 40]
    files = []
    if dist.get_rank() == 0:
        for s in range(8):
            path = Path(out) / f"part{s}.jsonl"
            path.write_text("".join(json.dumps(e) + "\n" for e in examples[cuts[s]:cuts[s + 1]]))
    dist.barrier()
    files = [str(Path(out) / f"part{s}.jsonl") for s in range(8)]
    collator = VLMPackingCollator(tokenizer, max_length=1024)

    def run(resume: str | None) -> list:
        packs = StreamingPackDataset(load_dataset("json", data_files=files, split="train", streaming=True),
                                     collator, pack_size=256, buffer_size=8, seed=3)
        model = enable_packing(tiny_model("qwen2", layers=1, vocab_size=len(tokenizer)))
        seen = []

        def record(module, args, kwargs):
            stream = kwargs["vlm_pack"]["stream"]
            seen.append("pad" if stream.get("pad") else [stream["epoch"], stream["samples"]])

        model.register_forward_pre_hook(record, with_kwargs=True)
        args = ref.training_args(out, max_steps=9, per_device_train_batch_size=1, save_strategy="steps",
                                 save_steps=3, dataloader_num_workers=2, ignore_data_skip=True,
                                 accelerator_config={"dispatch_batches": False})
        Trainer(model=model, args=args, train_dataset=packs, data_collator=packs.collate_fn,
                callbacks=[StreamingPackCallback(packs)]).train(resume_from_checkpoint=resume)
        return seen

    full = run(None)
    resumed = run(os.path.join(out, "checkpoint-6"))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"full": full, "resumed": resumed})
    return {"ranks": gathered, "samples": len(examples)}


CASES = {
    "ddp_vlm": vlm_case,
    "ddp_per_rank_mean": lambda out: packed_sft_case(out, average_tokens=False),
    "ddp_packed_dataset": packed_dataset_case,
    "ddp_packed_sft": packed_sft_case,
    "ddp_token_budget": token_budget_case,
    "fsdp2": fsdp2_case,
    "sampler": sampler_case,
    "stream": stream_case,
    "zero2": lambda out: zero_case(out, 2),
    "zero3": lambda out: zero_case(out, 3),
}


def main() -> None:
    output, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results, pending = {}, {}
    for name in names:
        if name.startswith("zero"):  # references first: after ZeRO-3, new models are built partitioned
            compare(results, pending)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            shared = [scratch]
            dist.broadcast_object_list(shared)  # one directory for both ranks (checkpoints are written by rank 0)
            results[name] = CASES[name](shared[0])
            dist.barrier()
        if COMPARE in results[name]:
            pending[name] = results[name].pop(COMPARE)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    compare(results, pending)
    if dist.get_rank() == 0:
        print(f"vlm_pack worker: references {time.perf_counter() - start:.1f} s", flush=True)
        for name, result in results.items():
            print(f"vlm_pack worker: {name}: {json.dumps(result)[:300]}", flush=True)
    if dist.get_rank() == 0:
        Path(output).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
