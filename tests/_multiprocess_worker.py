"""Worker for tests/test_multiprocess.py: several 2-process checks in ONE process-group launch (gloo, CPU).

``python -m torch.distributed.run --nproc_per_node 2 tests/_multiprocess_worker.py OUT.json CASE [CASE ...]``

Each case trains (Trainer + DDP / DeepSpeed, or torch FSDP2 directly) and rank 0 writes what the test asserts:
the relative L2 error of the step-1 gradient (or weight update / learning rate, under ZeRO) against each sample
of the global batch run ALONE through the stock sdpa model with the token mean over both ranks and the whole
accumulation window (tests/test_trainer.py's references), the engine that actually ran, warnings logged, and
the samples each rank consumed. References are built after training, split between the ranks. The packed side's
chunked loss (vlm_pack.core.chunked_loss) runs with 16 target slots per chunk, so every row spans several chunks.
"""

from __future__ import annotations

import contextlib
import functools
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
from transformers import AutoTokenizer, Trainer  # noqa: E402

import test_trainer as ref  # noqa: E402  (the single-process references: each sample alone, stock sdpa)
import vlm_pack.core.chunked_loss  # noqa: E402
import vlm_pack.integrations.token_mean  # noqa: E402
from vlm_pack import VLMPackingCollator  # noqa: E402
from vlm_pack.integrations.hf_model import enable_packing  # noqa: E402
from vlm_pack.offline.dataset import PackedDataset, PackedSFTDataset  # noqa: E402
from vlm_pack.offline.storage import PackedArrays, build_index, write_packed  # noqa: E402
from vlm_pack.testing.tiny_families import TINY_VLM_FAMILIES  # noqa: E402
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, qwen_tokenizer, tiny_model  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", 2))  # 2 in the suite; 4 = SP 2 x DP 2 for sp_text, run by hand
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


OWNERS: dict[str, int] = {}  # reference key -> the rank that builds it (kept across compare calls, as is ...)
REFERENCES: dict[str, dict] = {}  # ... each rank's cache of the references it built


def compare(results: dict, pending: dict) -> None:
    """The deferred comparisons: each distinct reference is built by one rank (alternating, so the two heavy
    VLM references run in parallel), which scores every case that uses it; the errors are then shared."""
    for key in dict.fromkeys(key for key, _, _ in pending.values()):
        OWNERS.setdefault(key, len(OWNERS) % WORLD)
    errors = {}
    for name, (key, grads, build) in pending.items():
        if OWNERS[key] == dist.get_rank():
            if key not in REFERENCES:
                REFERENCES[key] = build()
            errors[name] = ref.relative_error(trained_part(grads, REFERENCES[key]), REFERENCES[key])
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, errors)
    for part in gathered:
        for name, error in part.items():
            results[name]["error"] = error
    pending.clear()


def trained_part(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``update`` on the parameters the reference gives a gradient; the others (e.g. the head of a SigLIP tower that
    LLaVA never calls) must not have moved."""
    moved = sorted(name for name in set(update) - set(reference) if update[name].any())
    assert not moved, f"parameters without a reference gradient changed: {moved[:4]}"
    return {name: update[name] for name in reference}


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


def head_loss_record(model) -> list[str]:
    """What each training forward of ``model``'s loss owner returned as logits, and whether DeepSpeed ZeRO-3
    manages its head: 'DeferredLogits zero3' is the chunked loss on a partitioned head (not the model's own loss)."""
    from vlm_pack.integrations.head_loss import loss_owner

    owner, seen = loss_owner(model), []

    def record(module, args, output):
        if module.training:
            weight = dict(module.get_output_embeddings().named_parameters())["weight"]  # no ZeRO-3 gather
            managed = hasattr(weight, "ds_id")
            seen.append(f"{type(output.logits).__name__}{' zero3' if managed else ''}")

    owner.register_forward_hook(record)  # after enable_packing's hooks: sees the output they built
    return seen


class DroppedHeadGrad:
    """Corruption: the chunked loss's fused path computes the head's gradient but hands back zeros (the gathered
    weight's gradient lost on its way to ZeRO-3's partition)."""

    def __enter__(self):
        fused = vlm_pack.core.chunked_loss._FusedLinearCrossEntropy
        self.original = fused.backward

        def backward(ctx, grad_output):
            grads = self.original(ctx, grad_output)
            return (grads[0], torch.zeros_like(grads[1]), *grads[2:])  # (None: DeepSpeed's hook fails on it)

        fused.backward = staticmethod(backward)

    def __exit__(self, *exc):
        vlm_pack.core.chunked_loss._FusedLinearCrossEntropy.backward = staticmethod(self.original)


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


def sft_packs(directory: str, per_pack=(3, 3, 3, 3)) -> tuple[PackedSFTDataset, list, list]:
    """Four packs of three samples on disk (what `vlm-pack prepare` writes), prompt tokens masked."""
    samples = ref.random_samples()
    rng = np.random.default_rng(8)
    masks = [(np.arange(len(s)) >= rng.integers(1, len(s))).astype(np.uint8) for s in samples]
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in samples])))
    arrays = PackedArrays(index=build_index(np.array(per_pack), offsets), tokens=np.concatenate(samples),
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

def fsdp2_case(out: str, shard_head: bool = False) -> dict:
    """FSDP2 on a packed Llama: rank r takes packs r and r + 2 (accumulation 2); the loss denominator is the
    label-token count of all four packs (the global token mean), times the world size because FSDP averages.
    ``shard_head``: the LM head sharded on its own (resharded after its forward: a DTensor when the loss reads it)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vlm_pack.core.batch import model_inputs

    samples = ref.random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), qwen_tokenizer(), 40)
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB)).train()  # training: chunked loss
    for layer in model.model.layers:
        fully_shard(layer)
    if shard_head:
        fully_shard(model.lm_head)
    fully_shard(model)
    batches = [packs.collate([packs[k]]) for k in range(len(packs))]
    total = sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batches)
    seen = head_loss_record(model)
    for k in range(dist.get_rank(), len(packs), WORLD):
        try:
            loss = model(**model_inputs(batches[k], keep_labels=True), use_cache=False, num_items_in_batch=total).loss
        except ValueError as error:  # a head sharded on its own: refused by name at the first loss
            if not shard_head:
                raise
            return {"refused": str(error)}
        (loss * WORLD).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"engine": type(model).__name__, "sharded": sharded, "head_loss": sorted(set(seen)),
            COMPARE: ("text", grads, lambda: ref.text_reference(samples))}


# ---- DeepSpeed ZeRO through Trainer ---------------------------------------------------------------------------

def zero_case(out: str, stage: int, corrupt: bool = False) -> dict:
    """ZeRO hides ``.grad``: compare the weight update of one SGD step (lr 1, no momentum, no clipping) with
    -lr x the reference gradient, with Trainer's own torch SGD inside DeepSpeed. Runs last in a launch: ZeRO-3
    changes how transformers builds later models. The loss is the chunked one (under ZeRO-3 on the partitioned
    head, read inside the forward); ``corrupt``: its head gradient dropped (:class:`DroppedHeadGrad`)."""
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
    fresh_sequence_parallel()  # (and after an earlier ZeRO-3 case)
    reference = ref.text_reference(samples)
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=ref.VOCAB))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = ref.training_args(out, per_device_train_batch_size=1, remove_unused_columns=True, deepspeed=config,
                             learning_rate=1.0)  # a large step: the update w - w' keeps more fp32 digits
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=packs.collate)
    seen = head_loss_record(model)
    with DroppedHeadGrad() if corrupt else contextlib.nullcontext():
        trainer.train()
    wrapped = trainer.model_wrapped
    after = {n: safe_get_full_fp32_param(p) for n, p in wrapped.module.named_parameters()}
    result = {"engine": type(wrapped).__name__, "stage": wrapped.zero_optimization_stage(),
              "head_loss": sorted(set(seen))}
    update = {n: (before[n] - after[n]) / args.learning_rate for n in reference}
    result["error"] = ref.relative_error(update, reference)
    return result


# ---- DeepSpeed Ulysses sequence parallelism (SP = 2) through Trainer -------------------------------------------

def fresh_sequence_parallel() -> None:
    """Between SP cases (a test-harness reset): DeepSpeed builds its SP groups once per process and asserts they are
    new, and transformers builds new models partitioned while an earlier ZeRO-3 Trainer's config is alive."""
    import gc

    import deepspeed.ops
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see zero_case
    gc.collect()
    unset_hf_deepspeed_config()
    groups._release_process_group_references()


def per_rank_mean_trainer():
    """Corruption: each rank's own token mean of each micro-batch (a per-rank loss), averaged by the engine."""
    from vlm_pack.sequence_parallel import UlyssesTrainer

    class PerRankMeanTrainer(UlyssesTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            local = (inputs["shift_labels"] != -100).sum().clamp(min=1)
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * num_items_in_batch / (local * dist.get_world_size() * self.args.gradient_accumulation_steps)

    return PerRankMeanTrainer


def sp_train(out: str, model, dataset, collate, width: int, corrupt: str | None = None, accumulation: int = 2,
             **arguments) -> dict:
    """One SGD step (lr 1) of UlyssesTrainer under SP = 2 + ZeRO-3 (DP = 1): 2 rows, accumulation 2 (each rank
    loads one row; the adapter runs both rows on both ranks). Returns the weight update (ZeRO hides .grad)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from vlm_pack.sequence_parallel import UlyssesTrainer, ulysses_setup, zero3_config

    setup = ulysses_setup(model, collate, 2, pad_to_length=width)
    trainer_cls = per_rank_mean_trainer() if corrupt == "rank_mean" else UlyssesTrainer
    if corrupt == "vision_sliced":  # the vision tower's attention under the Ulysses wrapper too
        model.set_attn_implementation(setup.parallelism_config.sp_handler.sp_attn_implementation)
    collator = setup.data_collator
    if corrupt == "positions":  # no boundaries and positions running on through the row
        collator = Unrestarted(collator)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = head_loss_record(model)
    args = ref.training_args(out, per_device_train_batch_size=1, deepspeed=zero3_config(), learning_rate=1.0,
                             parallelism_config=setup.parallelism_config, gradient_accumulation_steps=accumulation,
                             **arguments)
    try:
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=collator)
    except ValueError as error:
        if arguments.get("use_cpu", True):
            raise
        return {"refused": str(error)}  # Trainer's default device choice on CPU: refused when built
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001  (the corruption that must fail loudly)
        if corrupt != "vision_sliced":
            raise
        return {"failed": f"{type(error).__name__}: {str(error)[:200]}"}
    wrapped = trainer.model_wrapped
    after = {n: safe_get_full_fp32_param(p) for n, p in wrapped.module.named_parameters()}
    return {"engine": type(wrapped).__name__, "stage": wrapped.zero_optimization_stage(),
            "sp": trainer.accelerator.parallelism_config.sp_size, "head_loss": sorted(set(seen)),
            "update": {n: before[n] - after[n] for n in before}}


class Unrestarted:
    """Corruption: the row's boundaries dropped and its positions counting on (0..T-1)."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, items):
        from vlm_pack.sequence_parallel.batch import SP_KEY

        batch = self.collator(items)
        row = batch[SP_KEY]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            row.pop(key)
        width = batch["input_ids"].shape[-1]
        row["position_ids"] = batch["position_ids"] = torch.arange(width)[None]
        return batch


def tiny_text_model(family: str):
    """The tiny text model of ``family`` (seeded: the same weights at every build) over ids below ``ref.VOCAB``."""
    if family != "mistral":
        return tiny_model(family, layers=1, vocab_size=ref.VOCAB)
    from transformers import MistralForCausalLM

    from vlm_pack.testing.tiny_families import mistral_text_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MistralForCausalLM._from_config(mistral_text_config(ref.VOCAB, layers=1), attn_implementation="sdpa",
                                               dtype=torch.float32).eval()


def sp_text_case(out: str, family: str = "llama", corrupt: str | None = None, **arguments) -> dict:
    """A text family on two offline packs of six samples (prompt tokens masked): reference key 'text_masked' (Llama)
    or 'text_<family>'."""
    fresh_sequence_parallel()
    packs, samples, masks = sft_packs(out, per_pack=(6, 6) if WORLD == 2 else (12 // WORLD,) * WORLD)
    model = tiny_text_model(family)
    result = sp_train(out, model, packs, packs.collate_fn, width=ref.PACK, corrupt=corrupt, **arguments)
    update = result.pop("update", None)
    if update is None:
        return result
    key = "text_masked" if family == "llama" else f"text_{family}"
    return {**result, COMPARE: (key, update, lambda: ref.text_reference(samples, masks, tiny_text_model(family)))}


def sp_vlm_case(out: str, family: str = "qwen2_vl", video: bool = False, corrupt: str | None = None) -> dict:
    """Rows of several examples (grouped_rows): Qwen2-VL / Qwen3-VL on the eight image / text examples of ddp_vlm,
    four per row (reference key 'vlm' / the family); Qwen2.5-VL on the video / image / text examples of
    tests/test_video.py, two per row (key 'video'); the families of vlm_pack.testing.tiny_families (GLM-4V,
    InternVL, LLaVA-OneVision, Mistral3, Idefics3, ...) on two photos + two text chats, two per row."""
    from vlm_pack.sequence_parallel import grouped_rows

    fresh_sequence_parallel()
    # Qwen3-VL with 2 text layers: deepstack features are added after layer 0, so the wrong rows would reach the loss
    build = lambda: tiny_model(family, layers=2 if family == "qwen3_vl" else 1)  # noqa: E731
    if video:
        import test_video

        proc, examples, per_row, key = test_video.processor_for(family), test_video.examples(), 2, "video"
    elif family in TINY_VLM_FAMILIES:
        from vlm_pack.testing.data import photo_examples, text_chat_examples
        from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

        proc = tiny_vlm_processor(family)
        examples = photo_examples(2, seed=5, max_side=56) + text_chat_examples(2, seed=5)
        per_row, key = 2, family
        build = lambda: tiny_vlm(family, proc, layers=1).train()  # noqa: E731
    else:
        proc, examples = ref.family_setup(family, offline_qwen2vl_processor(), qwen_tokenizer())
        per_row, key = 4, "vlm" if family == "qwen2_vl" else family
    model = build()
    collator = VLMPackingCollator(proc, max_length=1024, model_config=model.config)
    rows = grouped_rows(examples, per_row)
    width = max(collator(rows[i])["input_ids"].shape[-1] for i in range(len(rows)))
    result = sp_train(out, model, rows, collator, width=width + width % 2, corrupt=corrupt)
    update = result.pop("update", None)
    if update is None:
        return result
    return {**result, COMPARE: (key, update, lambda: ref.reference_grads(family, proc, examples, stock=build()))}


def sp_token_budget_case(out: str) -> dict:
    """Qwen2-VL on ddp_token_budget's four token-budget packs (reference key 'token_budget'): each rank loads two,
    so accumulation 4 puts all four in the step."""
    from vlm_pack.budget import TokenBudgetPackDataset, measure_lengths, plan_token_budget_packs
    from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples

    fresh_sequence_parallel()
    processor = offline_qwen2vl_processor()
    examples = photo_examples(4, seed=3, max_side=84) + easy_vqa_examples(4, seed=3) + text_chat_examples(4, seed=3)
    model = tiny_model("qwen2_vl", layers=1)
    collator = VLMPackingCollator(processor, max_length=256, model_config=model.config)
    plan = plan_token_budget_packs(measure_lengths(examples, collator, progress=False), 192, data_parallel_size=WORLD)
    assert plan.num_packs == 4, plan.num_packs
    packs = TokenBudgetPackDataset(examples, plan, collator)
    result = sp_train(out, model, packs, packs.collate_fn, width=192, accumulation=4)
    update = result.pop("update")
    return {**result, COMPARE: ("token_budget", update, lambda: ref.reference_grads("qwen2_vl", processor, examples))}


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


def _stream_files(out: str, name: str, parts: list[list[dict]]) -> list[str]:
    """JSONL files of ``parts`` (written by rank 0), the same paths on both ranks."""
    files = [str(Path(out) / f"{name}{s}.jsonl") for s in range(len(parts))]
    if dist.get_rank() == 0:
        for path, part in zip(files, parts):
            Path(path).write_text("".join(json.dumps(e) + "\n" for e in part))
    dist.barrier()
    return files


def _stream_trainer(out: str, files: list[str] | None, resume: str | None = None, source=None,
                    **args) -> tuple[list, Trainer]:
    """Trainer over streaming packs of ``files`` (tiny Qwen2, pack 256, buffer 8, 2 workers, accumulation 2): every
    forward's [epoch, samples] or "pad". A resumed run loads the tokenizer from a folder of its own."""
    from datasets import load_dataset

    from vlm_pack.streaming import StreamingPackCallback, StreamingPackDataset

    tokenizer = qwen_tokenizer()
    if resume is not None:  # the resumed run loads the same tokenizer from its own folder (another node's copy)
        folder = Path(out) / f"tokenizer-rank{dist.get_rank()}"
        tokenizer.save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if source is None:
        source = load_dataset("json", data_files=files, split="train", streaming=True)
    packs = StreamingPackDataset(source,
                                 VLMPackingCollator(tokenizer, max_length=1024), pack_size=256, buffer_size=8, seed=3)
    model = enable_packing(tiny_model("qwen2", layers=1, vocab_size=len(tokenizer)))
    seen = []

    def record(module, args, kwargs):
        stream = kwargs["vlm_pack"]["stream"]
        seen.append("pad" if stream.get("pad") else [stream["epoch"], stream["samples"]])

    model.register_forward_pre_hook(record, with_kwargs=True)
    args = ref.training_args(out, per_device_train_batch_size=1, dataloader_num_workers=2, ignore_data_skip=True,
                             accelerator_config={"dispatch_batches": False}, **args)
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=packs.collate_fn,
                      callbacks=[StreamingPackCallback(packs)])
    trainer.train(resume_from_checkpoint=resume)
    return seen, trainer


def stream_case(out: str) -> dict:
    """Streaming packs (vlm_pack.streaming) through Trainer: 2 ranks x 2 DataLoader workers over 2 JSONL files of
    40 chats (fewer files than the 4 units: every unit reads every file and keeps its rows), accumulation 2,
    9 steps (2+ epochs), a checkpoint every 3 steps; runs resumed from copies of checkpoint-3 and checkpoint-6 (in
    another folder, rank 0's copy: the plain ``resume_from_checkpoint`` recipe). Each rank reports every forward's
    samples, epoch or "pad"."""
    import shutil

    from vlm_pack.testing.data import text_chat_examples

    examples = text_chat_examples(40, seed=11)
    files = _stream_files(out, "stream", [examples[:18], examples[18:]])
    full, _ = _stream_trainer(out, files, max_steps=9, save_strategy="steps", save_steps=3)
    resumed = {}
    for step in (3, 6):
        copy = os.path.join(out, "copies", f"saved-{step}")
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(out, f"checkpoint-{step}"), copy)
        dist.barrier()
        resumed[step], _ = _stream_trainer(os.path.join(out, f"resumed-{step}"), files, resume=copy, max_steps=9)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"full": full, "resumed": resumed})
    return {"ranks": gathered, "samples": len(examples)}


def _chats(n, seed, shards):
    """A user's generator: its own list argument named ``shards`` (residues of the row index, 2 shards)."""
    from vlm_pack.testing.data import text_chat_examples

    examples = text_chat_examples(n, seed=seed)
    for residue in shards:
        yield from examples[residue::2]


def stream_generator_case(out: str) -> dict:
    """stream_case over ``IterableDataset.from_generator(gen, gen_kwargs={"n": 40, "seed": 11, "shards": [0, 1]})``
    (kept apart from the suite; issue 45's crash): same report."""
    import shutil

    from datasets import IterableDataset

    def source():
        return IterableDataset.from_generator(_chats, gen_kwargs={"n": 40, "seed": 11, "shards": [0, 1]})

    full, _ = _stream_trainer(out, None, source=source(), max_steps=9, save_strategy="steps", save_steps=3)
    resumed = {}
    for step in (3, 6):
        copy = os.path.join(out, "copies", f"saved-{step}")
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(out, f"checkpoint-{step}"), copy)
        dist.barrier()
        resumed[step], _ = _stream_trainer(os.path.join(out, f"resumed-{step}"), None, resume=copy, source=source(),
                                           max_steps=9)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"full": full, "resumed": resumed})
    return {"ranks": gathered, "samples": 40}


def stream_error_case(out: str) -> dict:
    """Rank 1's stream holds a chat with nothing to train on at line 20 (an error in its data pipeline, raised in a
    DataLoader worker after some packs): every rank must end with an error, none wait. Each rank reports its
    error and the seconds until it."""
    from vlm_pack.testing.data import text_chat_examples

    examples = text_chat_examples(30, seed=12)
    bad = [*examples[:19], {"messages": [{"role": "user", "content": "a question, no answer"}]}, *examples[19:]]
    files = _stream_files(out, "error", [examples, bad])
    start = time.perf_counter()
    try:
        _stream_trainer(out, [files[dist.get_rank()]], max_steps=20)
        error = None
    except Exception as err:  # noqa: BLE001  (what the rank stopped with is the result)
        error = f"{type(err).__name__}: {err}"
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"error": error, "seconds": round(time.perf_counter() - start, 1)})
    return {"ranks": gathered, "bad_file": files[1]}


SP_TEXT_FAMILIES = ("qwen2", "qwen3", "mistral")  # besides Llama (sp_text)
SP_VLM_FAMILIES = ("glm4v", "internvl", "llava_onevision", "mistral3", "idefics3")
CASES = {
    "ddp_vlm": vlm_case,
    "ddp_per_rank_mean": lambda out: packed_sft_case(out, average_tokens=False),
    "ddp_packed_dataset": packed_dataset_case,
    "ddp_packed_sft": packed_sft_case,
    "ddp_token_budget": token_budget_case,
    "fsdp2": fsdp2_case,
    "fsdp2_sharded_head": lambda out: fsdp2_case(out, shard_head=True),
    "sampler": sampler_case,
    "stream_2_files": stream_case,
    "stream_error": stream_error_case,
    "stream_generator": stream_generator_case,  # kept apart from the suite (issue 45's out-of-suite stream check)
    "zero2": lambda out: zero_case(out, 2),
    "zero3": lambda out: zero_case(out, 3),
    "zero3_head_grad_dropped": lambda out: zero_case(out, 3, corrupt=True),
    "sp_text": sp_text_case,
    "sp_video": lambda out: sp_vlm_case(out, "qwen2_5_vl", video=True),
    "sp_token_budget": sp_token_budget_case,
    "sp_qwen3_vl": lambda out: sp_vlm_case(out, "qwen3_vl"),
    **{f"sp_{family}": functools.partial(sp_text_case, family=family) for family in SP_TEXT_FAMILIES},
    **{f"sp_{family}": functools.partial(sp_vlm_case, family=family) for family in SP_VLM_FAMILIES},
    "sp_positions_not_restarted": lambda out: sp_text_case(out, corrupt="positions"),
    "sp_loss_per_rank_mean": lambda out: sp_text_case(out, corrupt="rank_mean"),
    "sp_cpu_without_use_cpu": lambda out: sp_text_case(out, use_cpu=False),  # Trainer's default device choice
    "sp_vision_tower_sliced": lambda out: sp_vlm_case(out, corrupt="vision_sliced"),
}


def main() -> None:
    output, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    vlm_pack.core.chunked_loss.DEFAULT_CHUNK_BYTES = 0  # 16 target slots per chunk: every row spans several
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
    if any(name.startswith("sp_") for name in names):
        fresh_sequence_parallel()  # references unpartitioned, after the last ZeRO-3 Trainer
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
