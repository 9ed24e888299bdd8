"""Streaming (``IterableDataset``) data in Trainer and TRL, with DataLoader workers: exact, or refused clearly.

accelerate's ``dispatch_batches`` (on by default for an ``IterableDataset``) slices every tensor of a batch along
dim 0; a packed batch (one row, per-sample vision tensors, ``cu_seq_lens_q``) cannot survive that, so the recipe
switches it off with ``accelerator_config={"dispatch_batches": False}`` and each process packs its own samples.
Step-1 gradients then equal each sample run alone through a stock sdpa model (tests/test_trainer.py's reference);
left on, the first forward refuses the cut batch naming the flag.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_dataset
from test_trainer import reference_grads, relative_error, sft_config, trainer_grads, training_args
from vlm_pack import PackedSFTTrainer, VLMPackingCollator, enable_packing, to_hf_dataset
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.core.batch import model_inputs
from vlm_pack.integrations.hf_model import DISPATCH_FIX
from vlm_pack.testing.tiny_models import tiny_model
from tolerance import GRAD_REL_L2

NO_DISPATCH = {"dispatch_batches": False}


@pytest.fixture(scope="module")
def vlm_setup(processor):
    """4 chat examples (photos, VQA, text) and their unpacked reference gradients."""
    examples = photo_examples(2, seed=5, max_side=56) + easy_vqa_examples(1, seed=5) + text_chat_examples(1, seed=5)
    return examples, reference_grads("qwen2_vl", processor, examples)


def packed_qwen2_vl(processor):
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    return model, VLMPackingCollator(processor, max_length=512, model_config=model.config)


def test_trainer_on_a_stream_with_workers_equals_unpacked(processor, vlm_setup, tmp_path):
    """2 shards, 2 workers: each worker packs one micro-batch of 2; the step's window (2 x 2) holds all 4 samples."""
    examples, reference = vlm_setup
    model, collator = packed_qwen2_vl(processor)
    stream = to_hf_dataset(examples).to_iterable_dataset(num_shards=2)
    args = training_args(tmp_path, per_device_train_batch_size=2, dataloader_num_workers=2,
                         accelerator_config=NO_DISPATCH)
    error = relative_error(trainer_grads(model, stream, collator, args), reference)
    print(f"streaming Trainer: relative L2 {error:.2e}")
    assert error < GRAD_REL_L2


def test_dispatched_batches_are_refused_naming_the_flag(processor, vlm_setup, tmp_path):
    """Trainer's default for a stream: accelerate cuts the packed batch to its first row; refused with the fix."""
    examples, _ = vlm_setup
    model, collator = packed_qwen2_vl(processor)
    stream = to_hf_dataset(examples).to_iterable_dataset()
    with pytest.raises(ValueError, match="dispatch_batches.*" + DISPATCH_FIX.replace("{", r"\{").replace("}", r"\}")):
        trainer_grads(model, stream, collator, training_args(tmp_path))


def test_trl_on_a_streamed_jsonl_with_workers_equals_unpacked(processor, tmp_path):
    """TRL on ``load_dataset("json", streaming=True)`` over two local JSONL files (one per worker), through
    ``vlm_pack.PackedSFTTrainer`` (an ``SFTTrainer`` that switches ``dispatch_batches`` off itself)."""
    examples = text_chat_examples(4, seed=5)
    files = []
    for shard in range(2):
        path = tmp_path / f"part{shard}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in examples[2 * shard:2 * shard + 2]))
        files.append(str(path))
    stream = load_dataset("json", data_files=files, split="train", streaming=True)
    model, collator = packed_qwen2_vl(processor)
    args = sft_config(tmp_path, per_device_train_batch_size=2, dataloader_num_workers=2, remove_unused_columns=False,
                      dataset_kwargs={"skip_prepare_dataset": True})  # PackedSFTTrainer switches dispatch_batches off
    grads = trainer_grads(model, stream, collator, args, trainer_cls=PackedSFTTrainer, processing_class=processor)
    error = relative_error(grads, reference_grads("qwen2_vl", processor, examples))
    print(f"streaming TRL: relative L2 {error:.2e}")
    assert error < GRAD_REL_L2


def test_trl_evaluates_a_streamed_eval_set_with_a_map_style_train_set(processor, tmp_path):
    """TRL switches dispatch_batches off only for a streamed TRAINING set (before it builds the accelerator); with a
    map-style one and a streamed evaluation set, PackedSFTTrainer must switch it off on the built accelerator.
    eval_loss (all 4 samples in one micro-batch) equals the token mean of each sample alone through a stock model."""
    examples = text_chat_examples(4, seed=6)
    model, collator = packed_qwen2_vl(processor)
    args = sft_config(tmp_path, per_device_eval_batch_size=4, remove_unused_columns=False,
                      dataset_kwargs={"skip_prepare_dataset": True})
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=to_hf_dataset(examples),
                               eval_dataset=to_hf_dataset(examples).to_iterable_dataset(), data_collator=collator,
                               processing_class=processor)
    loss = trainer.evaluate()["eval_loss"]
    stock = tiny_model("qwen2_vl", layers=1)
    alone = VLMPackingCollator(processor, max_length=512, model_config=stock.config, pack_sequences_in_batch=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            batch = alone([example])
            targets = int((batch["labels"][0, 1:] != -100).sum())
            inputs = {k: v for k, v in model_inputs(batch, keep_labels=True).items() if k != "attention_mask"}
            total, count = total + float(stock(**inputs, use_cache=False).loss) * targets, count + targets
    assert abs(loss - total / count) < 1e-4 * total / count  # a stated bound (tests/test_trainer_eval.py's)
