"""transformers.Trainer with the README recipe is exact under gradient accumulation, for every registered family.

Step-1 gradients of ``Trainer(model=enable_packing(model), data_collator=collator)`` (micro-batch 4, 2 accumulation
steps, SGD, no clipping) equal the unpacked reference: each sample forwarded ALONE through a stock ``sdpa`` model,
loss = sum of plain shifted CE over all 8 samples / all label tokens. Corruptions (the ``accepts_loss_kwargs``
fix undone, the -100 first labels dropped) must break the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

import vlm_pack
import vlm_pack.models
from vlm_pack.batch import model_inputs
from vlm_pack.collator import VLMPackingCollator
from vlm_pack.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.hf import enable_packing
from vlm_pack.tiny_models import TINY_FAMILIES, qwen_tokenizer, tiny_model

VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TOLERANCE = 1e-4


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


def reference_grads(family: str, processor, examples: list, reduction: str = "token") -> dict[str, torch.Tensor]:
    """Each sample ALONE through a stock sdpa model; plain shifted CE; token mean (or per-sample mean) of all."""
    stock = tiny_model(family, layers=1)
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
    assert got is not None and got.keys() == want.keys()
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want])
    return float(diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm())


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


def family_setup(family: str, processor, tokenizer):
    """(processor for the family, 8 chat examples): images of several sizes + text-only, or text only."""
    if family in VLM_FAMILIES:
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
    """The README recipe: enable_packing + the collator, nothing else."""
    proc, examples = family_setup(family, processor, tokenizer)
    model = enable_packing(tiny_model(family, layers=1))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    return trainer_grads(model, examples, collator, training_args(tmp_path), **trainer_kwargs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_trainer_gradient_accumulation_equals_unpacked(family, processor, tokenizer, references, tmp_path):
    grads = run_recipe(family, processor, tokenizer, tmp_path)
    error = relative_error(grads, references(family))
    print(f"{family}: relative L2 {error:.2e}")
    assert error < TOLERANCE


def test_corruption_without_accepts_loss_kwargs(processor, tokenizer, references, tmp_path, monkeypatch):
    """Qwen2.5-VL declares accepts_loss_kwargs=False: without our fix Trainer averages micro-batch means."""
    registry = vlm_pack.models._REGISTRY
    monkeypatch.setitem(registry, "qwen2_5_vl", dataclasses.replace(registry["qwen2_5_vl"], loss_honours_num_items=False))
    grads = run_recipe("qwen2_5_vl", processor, tokenizer, tmp_path)
    assert relative_error(grads, references("qwen2_5_vl")) > 1e-3


def test_corruption_without_first_label_masking(processor, tokenizer, references, tmp_path, monkeypatch):
    """Labels left on each sample's first token: the model's whole-row shift predicts across boundaries."""
    monkeypatch.setattr(vlm_pack.collator, "mask_first_labels", lambda labels, starts: labels)
    grads = run_recipe("llama", processor, tokenizer, tmp_path)
    assert relative_error(grads, references("llama")) > 1e-3


def test_compute_loss_func_is_exact_for_a_model_whose_loss_ignores_num_items(processor, tokenizer, references,
                                                                              tmp_path):
    proc, examples = family_setup("qwen3_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen3_vl", layers=1))
    model.accepts_loss_kwargs = False  # as transformers ships Qwen3-VL
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    grads = trainer_grads(model, examples, collator, training_args(tmp_path),
                          compute_loss_func=vlm_pack.compute_loss_func)
    assert relative_error(grads, references("qwen3_vl")) < TOLERANCE


def test_sample_mean_loss_is_exact_and_refuses_short_windows(processor, tokenizer, references, tmp_path):
    proc, examples = family_setup("qwen2_vl", processor, tokenizer)
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    collator = VLMPackingCollator(proc, max_length=512, model_config=model.config)
    loss = vlm_pack.SampleMeanLoss(model)
    grads = trainer_grads(model, examples, collator, training_args(tmp_path), compute_loss_func=loss,
                          callbacks=[loss])
    assert relative_error(grads, references("qwen2_vl", "sample")) < TOLERANCE
    assert relative_error(grads, references("qwen2_vl")) > 1e-3  # a different reduction indeed
    with pytest.raises(ValueError, match="not a multiple of gradient_accumulation_steps=2"):
        trainer_grads(model, examples[:4], collator, training_args(tmp_path), compute_loss_func=loss,
                      callbacks=[loss])
