"""Evaluation with Trainer on packed batches, against each sample run ALONE through a stock sdpa model.

* ``evaluate()`` with :class:`vlm_pack.PackedEvaluation` reports ``eval_loss`` = the token mean over every target of
  the evaluation set (Trainer's own value, the mean of micro-batch means, is not; checked as the corruption);
* ``predict()`` + :func:`vlm_pack.split_predictions` give one record per sample (5 samples in 3 packed rows) whose
  labels, predicted tokens and token losses are the sample's own;
* a checkpoint saved after ``enable_packing`` keeps the user's ``use_cache``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, Trainer, TrainingArguments

import vlm_pack
import vlm_pack.core.chunked_loss
from vlm_pack.core.batch import model_inputs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_models import tiny_model


@pytest.fixture(autouse=True)
def small_loss_chunks(monkeypatch):
    """16 slots per chunk of the chunked loss / slot scores (its floor), so every packed row spans several chunks."""
    monkeypatch.setattr(vlm_pack.core.chunked_loss, "DEFAULT_CHUNK_BYTES", 0)


TOLERANCE = 1e-4  # relative, on fp32 losses; per-token losses: absolute


@pytest.fixture(scope="module")
def examples():
    return photo_examples(2, seed=4, max_side=56) + easy_vqa_examples(1, seed=4) + text_chat_examples(2, seed=4)


@pytest.fixture(scope="module")
def alone(processor, examples):
    """Per sample, run alone through the stock sdpa model: (labels, token losses, logits margin, predicted ids),
    aligned with the labels (slot t: predicted from slot t-1)."""
    stock = tiny_model("qwen2_vl", layers=1)
    single = VLMPackingCollator(processor, max_length=512, model_config=stock.config, pack_sequences_in_batch=False)
    out = []
    with torch.no_grad():
        for example in examples:
            batch = single([example])
            inputs = {k: v for k, v in model_inputs(batch).items() if k != "attention_mask"}
            logits = stock(**inputs, use_cache=False).logits[0, :-1]
            labels = batch["labels"][0]
            losses = F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="none")
            top2 = logits.topk(2, dim=-1).values
            out.append((labels.numpy(), F.pad(losses, (1, 0)).numpy(), F.pad(top2[:, 0] - top2[:, 1], (1, 0)).numpy(),
                        F.pad(logits.argmax(-1), (1, 0), value=-100).numpy()))
    return out


@pytest.fixture(scope="module")
def trainer(processor, tmp_path_factory):
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    evaluation = vlm_pack.PackedEvaluation(model)
    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("eval")), per_device_eval_batch_size=2,
                             remove_unused_columns=False, use_cpu=True, report_to="none", disable_tqdm=True)
    collator = VLMPackingCollator(processor, max_length=512, model_config=model.config)
    return Trainer(model=model, args=args, data_collator=collator, compute_metrics=evaluation.compute_metrics,
                   preprocess_logits_for_metrics=evaluation.preprocess_logits_for_metrics)


def token_mean(alone) -> float:
    total = sum(float(losses[labels != -100].sum()) for labels, losses, _, _ in alone)
    return total / sum(int((labels != -100).sum()) for labels, *_ in alone)


def test_evaluate_reports_the_token_mean(trainer, examples, alone):
    metrics = trainer.evaluate(examples)
    want = token_mean(alone)
    # The corruption: Trainer's own eval_loss (mean of the 3 micro-batch means) without the helper.
    plain = Trainer(model=trainer.model, args=trainer.args, data_collator=trainer.data_collator).evaluate(examples)
    print(f"eval_loss {metrics['eval_loss']:.6f}, plain Trainer {plain['eval_loss']:.6f}, token mean alone {want:.6f}")
    assert abs(metrics["eval_loss"] - want) / want < TOLERANCE
    assert abs(plain["eval_loss"] - want) / want > 5e-4  # 1.5e-3 measured; fp32 noise is ~1e-7


def test_predictions_split_per_sample(trainer, examples, alone):
    output = trainer.predict(examples)
    assert output.label_ids.shape[0] == 3  # 5 samples in 3 packed micro-batches
    samples = vlm_pack.split_predictions(output)
    assert len(samples) == len(examples)
    worst = max(float(np.abs(s.token_losses - a[1]).max()) for s, a in zip(samples, alone) if s.labels.size == a[0].size)
    print(f"split: {len(samples)} samples from {output.label_ids.shape[0]} rows, max |token loss - alone| {worst:.1e}")
    for sample, (labels, losses, margin, predicted) in zip(samples, alone):
        assert np.array_equal(sample.labels, labels)
        assert np.abs(sample.token_losses - losses).max() < TOLERANCE
        clear = sample.targets & (margin > 1e-3)  # no near-tie whose argmax fp32 noise could flip
        assert clear.sum() > 0.9 * sample.targets.sum()
        assert np.array_equal(sample.predictions[clear], predicted[clear])
    with pytest.raises(ValueError, match="preprocess_logits_for_metrics"):
        vlm_pack.split_predictions(Trainer(model=trainer.model, args=trainer.args,
                                           data_collator=trainer.data_collator).predict(examples[:2]))


def test_checkpoint_keeps_use_cache(trainer, tmp_path):
    """enable_packing leaves the config alone (a packed forward turns the cache off per call instead)."""
    trainer.save_model(str(tmp_path))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.get_text_config().use_cache is True
