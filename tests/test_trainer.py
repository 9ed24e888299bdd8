"""transformers.Trainer and TRL's SFTTrainer with the recipes of docs/trainer_and_trl.md are exact under gradient accumulation.

Step-1 gradients of ``Trainer(model=enable_packing(model), data_collator=collator)`` (micro-batch 4, 2 accumulation
steps, SGD, no clipping) equal the unpacked reference: each sample forwarded ALONE through a stock ``sdpa`` model,
loss = sum of plain shifted CE over all samples of the window / all label tokens. The same for every registered
family, for the offline packs (``PackedSFTDataset``, ``PackedDataset``) and for TRL (VLM collator and packs).
Corruptions (the ``accepts_loss_kwargs`` fix undone, the -100 first labels dropped) must break the comparison.
The packed side computes its loss from hidden states in chunks of 16 target slots (vlm_pack.core.chunked_loss,
the default of ``enable_packing``), so every row spans several chunks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import numpy as np
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

import vlm_pack
import vlm_pack.core.chunked_loss
import vlm_pack.models
import vlm_pack.offline.dataset
from vlm_pack.core.batch import model_inputs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import get_family
from vlm_pack.offline.dataset import PackedDataset, PackedSFTDataset
from vlm_pack.offline.storage import PackedArrays, build_index, write_packed
from vlm_pack.testing.tiny_families import TINY_VLM_FAMILIES, tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import TINY_FAMILIES, offline_gemma3_processor, qwen_tokenizer, tiny_config, tiny_model

from tolerance import GRAD_REL_L2
from version_gates import require_proven

@pytest.fixture(autouse=True)
def small_loss_chunks(monkeypatch):
    """16 target slots per chunk of the chunked loss (its floor), so every packed row spans several chunks."""
    monkeypatch.setattr(vlm_pack.core.chunked_loss, "DEFAULT_CHUNK_BYTES", 0)


VLM_FAMILIES = tuple(f for f in TINY_FAMILIES if hasattr(tiny_config(f), "vision_config"))


def layers_for(family: str) -> int:
    """One layer; two for hybrid families, whose first layer is linear attention (a full-attention one too)."""
    return 2 if "linear_attention" in get_family(tiny_config(family)).model.layer_kinds else 1


class GradCapture(TrainerCallback):
    """Gradients of the first optimizer step, read before the optimizer touches the weights."""

    grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def training_args(tmp_path, **overrides) -> TrainingArguments:
    """The recipe's arguments plus what the comparison needs (SGD, no clipping, one step, quiet)."""
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
        optim="sgd", learning_rate=0.1, max_grad_norm=0.0, remove_unused_columns=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
    )
    return TrainingArguments(**{**base, **overrides})


def trainer_grads(model, dataset, collator, args, trainer_cls=Trainer, **trainer_kwargs) -> dict[str, torch.Tensor]:
    capture = GradCapture()
    callbacks = [capture, *trainer_kwargs.pop("callbacks", [])]
    trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks,
                **trainer_kwargs).train()
    return capture.grads


def reference_grads(family: str, processor, examples: list, reduction: str = "token",
                    stock=None) -> dict[str, torch.Tensor]:
    """Each sample ALONE through a stock sdpa model; plain shifted CE; token mean (or per-sample mean) of all."""
    stock = tiny_model(family, layers=layers_for(family)) if stock is None else stock
    alone = VLMPackingCollator(processor, max_length=512, model_config=stock.config, pack_sequences_in_batch=False)
    sums, counts = [], []
    for example in examples:
        single = alone([example])
        inputs = {k: v for k, v in model_inputs(single).items() if k != "attention_mask"}
        logits = stock(**inputs, use_cache=False).logits[0]
        labels = single["labels"][0]
        sums.append(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))
        counts.append(int((labels[1:] != -100).sum()))
    if reduction == "token":
        loss = torch.stack(sums).sum() / sum(counts)
    else:
        loss = torch.stack([s / c for s, c in zip(sums, counts)]).mean()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.grad is not None}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got is not None and got.keys() == want.keys(), sorted(set(got) ^ set(want))[:6]
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want])
    return float(diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm())


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


# Gemma 4 has no offline processor that the collator can drive (tests/test_gemma4.py builds its image inputs by
# hand), so its Trainer run is text-only; every other VLM family trains on images of several sizes + text.
TEXT_ONLY = {"gemma4"}


def family_setup(family: str, processor, tokenizer):
    """(processor for the family, 8 chat examples): images of several sizes + text-only, or text only."""
    if family in VLM_FAMILIES and family not in TEXT_ONLY:
        if family == "gemma3":
            processor = offline_gemma3_processor()
        examples = photo_examples(4, seed=5, max_side=84) + easy_vqa_examples(2, seed=5) + text_chat_examples(2, seed=5)
        return processor, examples
    return tokenizer, text_chat_examples(8, seed=5)


@pytest.fixture(scope="module")
def references(processor, tokenizer):
    cache = {}

    def get(family: str, reduction: str = "token"):
        if (family, reduction) not in cache:
            proc, examples = family_setup(family, processor, tokenizer)
            cache[family, reduction] = reference_grads(family, proc, examples, reduction)
        return cache[family, reduction]

    return get


def run_recipe(family, processor, tokenizer, tmp_path, **trainer_kwargs):
    """The docs/trainer_and_trl.md recipe: enable_packing + the collator, nothing else."""
    proc, examples = family_setup(family, processor, tokenizer)
    model = enable_packing(tiny_model(family, layers=layers_for(family)))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    return trainer_grads(model, examples, collator, training_args(tmp_path), **trainer_kwargs)


@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
def test_trainer_gradient_accumulation_equals_unpacked_other_vlms(family, tmp_path):
    """Every family of vlm_pack.testing.tiny_families (LLaVA-OneVision, Mistral3, InternVL, Idefics3, SmolVLM, GLM-4V and
    its MoE / 4.6V, the Qwen MoE VLMs, the LLaVA family, Aya / Cohere 2 Vision): their own offline processors and
    models, the same recipe and reference as below."""
    require_proven(family)
    processor = tiny_vlm_processor(family)
    examples = photo_examples(4, seed=5, max_side=84) + easy_vqa_examples(2, seed=5) + text_chat_examples(2, seed=5)
    reference = reference_grads(family, processor, examples, stock=tiny_vlm(family, processor, layers=1))
    model = enable_packing(tiny_vlm(family, processor, layers=1))
    collator = VLMPackingCollator(processor, max_length=512, model_config=model.config)
    error = relative_error(trainer_grads(model, examples, collator, training_args(tmp_path)), reference)
    print(f"{family}: relative L2 {error:.2e}")
    assert error < GRAD_REL_L2


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_trainer_gradient_accumulation_equals_unpacked(family, processor, tokenizer, references, tmp_path):
    grads = run_recipe(family, processor, tokenizer, tmp_path)
    error = relative_error(grads, references(family))
    print(f"{family}: relative L2 {error:.2e}")
    assert error < GRAD_REL_L2


def test_corruption_without_accepts_loss_kwargs(processor, tokenizer, references, tmp_path, monkeypatch):
    """Qwen2.5-VL declares accepts_loss_kwargs=False: without our fix Trainer averages micro-batch means."""
    registry = vlm_pack.models.registry._REGISTRY
    spec = registry["qwen2_5_vl"]
    unfixed = dataclasses.replace(spec, model=dataclasses.replace(spec.model, loss_honours_num_items=False))
    monkeypatch.setitem(registry, "qwen2_5_vl", unfixed)
    grads = run_recipe("qwen2_5_vl", processor, tokenizer, tmp_path)
    assert relative_error(grads, references("qwen2_5_vl")) > 1e-3


def test_compute_loss_func_is_exact_for_a_model_whose_loss_ignores_num_items(processor, tokenizer, references,
                                                                              tmp_path):
    proc, examples = family_setup("qwen3_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen3_vl", layers=1))
    model.accepts_loss_kwargs = False  # as transformers ships Qwen3-VL
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    grads = trainer_grads(model, examples, collator, training_args(tmp_path),
                          compute_loss_func=vlm_pack.compute_loss_func)
    assert relative_error(grads, references("qwen3_vl")) < GRAD_REL_L2


def test_sample_mean_loss_is_exact_and_refuses_short_windows(processor, tokenizer, references, tmp_path):
    proc, examples = family_setup("qwen2_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    loss = vlm_pack.SampleMeanLoss(model)
    grads = trainer_grads(model, examples, collator, training_args(tmp_path), compute_loss_func=loss,
                          callbacks=[loss])
    assert relative_error(grads, references("qwen2_vl", "sample")) < GRAD_REL_L2
    assert relative_error(grads, references("qwen2_vl")) > 1e-3  # a different reduction indeed
    with pytest.raises(ValueError, match="not a multiple of gradient_accumulation_steps=2"):
        trainer_grads(model, examples[:4], collator, training_args(tmp_path), compute_loss_func=loss,
                      callbacks=[loss])


# ---- TRL SFTTrainer: the VLM collator on the to_hf_dataset view ------------------------------------------------

def sft_config(tmp_path, **overrides) -> SFTConfig:
    """TRL's config with the comparison's settings; bf16 and gradient checkpointing off (CPU, fp32 reference)."""
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
        optim="sgd", learning_rate=0.1, max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
    )
    return SFTConfig(**{**base, **overrides})


def test_trl_vlm_collator_equals_unpacked(processor, tokenizer, references, tmp_path):
    proc, examples = family_setup("qwen2_5_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen2_5_vl", layers=1))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    dataset = vlm_pack.to_hf_dataset(examples)
    assert dataset.column_names == ["messages", "images"]
    grads = trainer_grads(model, dataset, collator, sft_config(tmp_path), trainer_cls=SFTTrainer,
                          processing_class=proc)
    assert relative_error(grads, references("qwen2_5_vl")) < GRAD_REL_L2


# ---- offline packs: PackedSFTDataset and PackedDataset, in Trainer and in TRL -----------------------------------

VOCAB = 5000  # random token ids below it: a small LM head keeps these runs fast
PACK = 96  # offline: 12 samples in 2 packs of 6 (micro-batch 1 x 2 steps); in memory: 4 packs of <= 40 tokens


def random_samples(seed: int = 7, lengths=(9, 14, 6, 11, 20, 7, 13, 5, 12, 16, 8, 10)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 5000, n) for n in lengths]


def text_reference(samples: list[np.ndarray], masks: list[np.ndarray] | None = None,
                   stock=None) -> dict[str, torch.Tensor]:
    """Each sample ALONE through a stock sdpa model (default: the tiny Llama); token t is a target where its mask is
    1 (all when None)."""
    stock = tiny_model("llama", layers=1, vocab_size=VOCAB) if stock is None else stock
    total, count = 0.0, 0
    for i, tokens in enumerate(samples):
        ids = torch.as_tensor(tokens, dtype=torch.long)
        labels = ids if masks is None else ids.masked_fill(~torch.as_tensor(masks[i], dtype=torch.bool), -100)
        logits = stock(input_ids=ids[None], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        count += int((labels[1:] != -100).sum())
    (total / count).backward()
    return {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def sft_packs(tmp_path_factory):
    """Two packs on disk (what `vlm-pack prepare` writes), prompt tokens masked, and their reference grads."""
    samples = random_samples()
    rng = np.random.default_rng(8)
    masks = [(np.arange(len(s)) >= rng.integers(1, len(s))).astype(np.uint8) for s in samples]
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in samples])))
    arrays = PackedArrays(
        index=build_index(np.array([6, 6]), offsets), tokens=np.concatenate(samples), loss_mask=np.concatenate(masks),
        seq_offsets=offsets, source_index=np.arange(len(samples)),
    )
    path = write_packed(tmp_path_factory.mktemp("packs") / f"training_{PACK}.npy", arrays)
    return PackedSFTDataset(path, PACK), text_reference(samples, masks)


@pytest.fixture(scope="module")
def in_memory_packs(tokenizer):
    """A PackedDataset of the same samples (labels = input_ids: only the -100 first labels keep samples apart)."""
    samples = random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), tokenizer, 40)
    assert len(packs) == 4
    return packs, text_reference(samples)


def packs_trainer_grads(packs, collate, batch_size: int, tmp_path) -> dict[str, torch.Tensor]:
    """The offline recipe: a packed tiny Llama in Trainer with default TrainingArguments (remove_unused_columns
    =True) apart from the micro-batch."""
    model = enable_packing(tiny_model("llama", layers=1, vocab_size=VOCAB))
    args = training_args(tmp_path, per_device_train_batch_size=batch_size, remove_unused_columns=True)
    return trainer_grads(model, packs, collate, args)


def test_trainer_packed_sft_dataset_default_arguments(sft_packs, tmp_path):
    """Micro-batch 1, which packs on disk require."""
    packs, reference = sft_packs
    assert relative_error(packs_trainer_grads(packs, packs.collate_fn, 1, tmp_path), reference) < GRAD_REL_L2


def test_trainer_packed_dataset_default_arguments(in_memory_packs, tmp_path):
    packs, reference = in_memory_packs
    assert relative_error(packs_trainer_grads(packs, packs.collate, 2, tmp_path), reference) < GRAD_REL_L2


def test_corruption_without_first_label_masking(in_memory_packs, tmp_path, monkeypatch):
    """Labels left on each sample's first token: the model's whole-row shift predicts across boundaries."""
    packs, reference = in_memory_packs
    original = packs.labels.copy()
    packs.labels[packs.seq_offsets[:-1]] = packs.tokens[packs.seq_offsets[:-1]]
    monkeypatch.setattr(vlm_pack.offline.dataset, "mask_first_labels", lambda labels, starts: labels)
    try:
        grads = packs_trainer_grads(packs, packs.collate, 2, tmp_path)
    finally:
        packs.labels[:] = original
    assert relative_error(grads, reference) > 1e-3


def test_trl_packs_equal_unpacked(sft_packs, in_memory_packs, tmp_path):
    for packs, collate, batch_size in ((sft_packs[0], sft_packs[0].collate_fn, 1),
                                       (in_memory_packs[0], in_memory_packs[0].collate, 2)):
        reference = sft_packs[1] if batch_size == 1 else in_memory_packs[1]
        model = enable_packing(tiny_model("llama", layers=1, vocab_size=VOCAB))
        dataset = vlm_pack.to_hf_dataset(packs)
        args = sft_config(tmp_path, per_device_train_batch_size=batch_size,
                          dataset_kwargs={"skip_prepare_dataset": True})
        grads = trainer_grads(model, dataset, collate, args, trainer_cls=SFTTrainer, processing_class=qwen_tokenizer())
        assert relative_error(grads, reference) < GRAD_REL_L2
