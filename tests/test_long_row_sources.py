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


def test_packed_sft_trainer_runs_trls_fused_head_in_small_tiles_exactly(tmp_path, monkeypatch):
    """PackedSFTTrainer's step runs TRL's fused head in vlm_pack's tiles (here 7 tokens x 300 of the 5000 ids, so
    tile edges fall inside samples and the vocabulary), restored after the step; its gradient equals TRL's own
    SFTTrainer (TRL's tiles) on the same packs and each sample alone through the stock model."""
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as trl_utils
    from test_trainer import random_samples, relative_error, sft_config, text_reference, trainer_grads
    from trl import SFTTrainer

    import vlm_pack.integrations.fused_tiles as fused_tiles
    from vlm_pack import PackedSFTTrainer, to_hf_dataset

    monkeypatch.setattr(fused_tiles, "TOKEN_TILE", 7)
    monkeypatch.setattr(fused_tiles, "VOCAB_TILE", 300)
    trl_tiles = (kernels.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)
    samples = random_samples()
    packs = PackedDataset(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}), qwen_tokenizer(), 40)
    grads, seen = {}, []
    for name, trainer_cls in (("packed", PackedSFTTrainer), ("trl", SFTTrainer)):
        model = enable_packing(tiny_model("llama", layers=1, vocab_size=5000))
        model.register_forward_pre_hook(
            lambda *_: seen.append((name, kernels.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)))
        args = sft_config(tmp_path / name, per_device_train_batch_size=2,
                          dataset_kwargs={"skip_prepare_dataset": True})
        grads[name] = trainer_grads(model, to_hf_dataset(packs), packs.collate, args, trainer_cls=trainer_cls,
                                    processing_class=qwen_tokenizer())
    assert {tuple(tiles) for who, *tiles in seen if who == "packed"} == {(7, 300)}
    assert {tuple(tiles) for who, *tiles in seen if who == "trl"} == {trl_tiles}
    assert (kernels.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == trl_tiles  # restored
    assert relative_error(grads["packed"], grads["trl"]) < GRAD_REL_L2
    assert relative_error(grads["packed"], text_reference(samples)) < GRAD_REL_L2
