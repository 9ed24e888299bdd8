"""TRL's logged ``num_tokens`` and ``mean_token_accuracy`` for packed Qwen2-VL batches, against their definitions
computed from each sample run ALONE through the stock sdpa model: the real token count and the share of label
tokens the model predicts top-1. The model is first fitted a few steps on the samples (a random model is never
right, so an accuracy of 0 would prove nothing). Plain ``SFTTrainer`` counts the mRoPE row ``[4, 1, T]`` as
``position_ids.size(1)`` = 1 token per micro-batch (the corruption); ``vlm_pack.PackedSFTTrainer`` counts ``T``.
"""

from __future__ import annotations

import pytest
import torch
from trl import SFTTrainer

import vlm_pack
from test_trainer import sft_config
from vlm_pack.core.batch import model_inputs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def fitted(processor):
    """(examples, fitted weights, real tokens, label tokens, top-1 hits), each sample alone through stock sdpa."""
    examples = text_chat_examples(4, seed=3)
    model = tiny_model("qwen2_vl", layers=1)
    alone = VLMPackingCollator(processor, max_length=512, model_config=model.config, pack_sequences_in_batch=False)
    batches = [model_inputs(alone([e]), keep_labels=True) for e in examples]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        sum(model(**b, use_cache=False).loss for b in batches).backward()
        optimizer.step()
    tokens = labelled = hits = 0
    with torch.no_grad():
        for b in batches:
            logits = model(**{k: v for k, v in b.items() if k != "labels"}, use_cache=False).logits[0, :-1]
            targets = b["labels"][0, 1:]
            scored = targets != -100
            top2 = logits[scored].topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-tie that fp32 noise could flip
            tokens += b["input_ids"].shape[1]
            labelled += int(scored.sum())
            hits += int((logits.argmax(-1) == targets)[scored].sum())
    assert 0 < hits < labelled
    return examples, model.state_dict(), tokens, hits / labelled


def logged(trainer_cls, processor, fitted, tmp_path) -> dict:
    examples, weights, _, _ = fitted
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    model.load_state_dict(weights)
    collator = VLMPackingCollator(processor, max_length=512, model_config=model.config)
    args = sft_config(tmp_path, gradient_accumulation_steps=1, learning_rate=0.0, logging_strategy="steps",
                      logging_steps=1, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = trainer_cls(model=model, args=args, train_dataset=vlm_pack.to_hf_dataset(examples),
                          data_collator=collator, processing_class=processor)
    trainer.train()
    return trainer.state.log_history[0]


def test_packed_sft_trainer_logs_the_real_token_count_and_accuracy(processor, fitted, tmp_path):
    _, _, tokens, accuracy = fitted
    log = logged(vlm_pack.PackedSFTTrainer, processor, fitted, tmp_path)
    print(f"num_tokens {log['num_tokens']} (real {tokens}), mean_token_accuracy {log['mean_token_accuracy']:.4f} "
          f"(alone {accuracy:.4f})")
    assert log["num_tokens"] == tokens
    assert abs(log["mean_token_accuracy"] - accuracy) < 1e-6
    plain = logged(SFTTrainer, processor, fitted, tmp_path)
    assert plain["num_tokens"] == 1  # TRL's position_ids.size(1) of one [4, 1, T] micro-batch
    assert abs(plain["mean_token_accuracy"] - accuracy) < 1e-6


def test_explicit_dispatch_batches_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dispatch_batches=True cuts packed batches apart"):
        vlm_pack.PackedSFTTrainer(model=None, args=sft_config(tmp_path, accelerator_config={"dispatch_batches": True}))
