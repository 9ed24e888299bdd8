"""Every vlm_pack batch source gives ``Trainer(compute_loss_func=vlm_pack.compute_loss_func)`` the chunked path:
the forward without labels (what Trainer sends with a ``compute_loss_func``) returns deferred logits, the step never
makes a ``T x V`` tensor, and the loss and gradients equal each sample ALONE through the stock sdpa model (plain
shifted cross entropy, token mean). The offline in-memory packs (``PackedDataset.collate``) carried no
``batch["vlm_pack"]`` before issue 45 and held 3.02x a row's logits; the corruption (their batch without that entry)
makes the full logits again."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset
from test_chunked_loss import LargestTensors
from tolerance import GRAD_REL_L2, grad_errors

import vlm_pack
from vlm_pack.core.batch import METADATA_KEY
from vlm_pack.integrations.head_loss import DeferredLogits
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.offline.dataset import PackedDataset
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_model

VOCAB = 5000  # above the small Qwen tokenizer's pad id (the fill)
LENGTHS = (9, 14, 6, 11, 20, 7)


def _samples():
    rng = np.random.default_rng(3)
    return [rng.integers(10, 4000, n).tolist() for n in LENGTHS]


def _model():
    return tiny_model("llama", layers=1, vocab_size=VOCAB)


def _reference(samples):
    model = _model()
    total, count = 0.0, 0
    for tokens in samples:
        ids = torch.tensor(tokens)
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        count += len(tokens) - 1
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_offline_in_memory_packs_take_the_chunked_loss_path():
    samples = _samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": samples}), qwen_tokenizer(), 80, pad_to_multiple_of=8)
    batch = packs.collate([packs[i] for i in range(len(packs))])  # every pack in one row, a trailing fill
    assert int(batch[METADATA_KEY]["cu_seqlens_padded"][-1]) == batch["input_ids"].shape[1] > sum(LENGTHS)
    want_loss, want = _reference(samples)
    model = enable_packing(_model(), loss_chunk_tokens=7)
    model.train()
    labels = batch.pop("labels")
    slots = batch["input_ids"].numel()
    with LargestTensors() as mode:
        outputs = model(**batch)
        assert isinstance(outputs.logits, DeferredLogits)
        loss = vlm_pack.compute_loss_func(outputs, labels, num_items_in_batch=None)
        loss.backward()
    assert mode.largest < slots * VOCAB, mode.largest
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(loss.item() - want_loss) / want_loss < GRAD_REL_L2
    assert max(grad_errors(got, want).values()) < GRAD_REL_L2
    # corruption: the same row without its bookkeeping returns the full logits
    bare = {k: v for k, v in batch.items() if k != METADATA_KEY}
    with LargestTensors() as mode:
        assert not isinstance(model(**bare).logits, DeferredLogits)
    assert mode.largest >= slots * VOCAB
