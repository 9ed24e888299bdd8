"""The collator packs models without mRoPE straight from the per-sample tensors (``pack_sequences``): the batch
is identical to the one the padded route (right-pad, then ``pack_batch_sequences``) builds."""

import pytest
import torch

import vlm_pack.data.collator as collator_module
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import text_chat_examples
from vlm_pack.core.packing import pack_batch_sequences
from vlm_pack.testing.tiny_models import qwen_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


@pytest.mark.parametrize("cp", [1, 2])
def test_text_batches_skip_the_padded_batch_and_match_the_padded_route(tokenizer, cp, monkeypatch):
    collator = VLMPackingCollator(tokenizer, max_length=512, context_parallel_size=cp)
    examples = text_chat_examples(5, seed=3)
    calls = []
    monkeypatch.setattr(collator_module, "pack_batch_sequences",
                        lambda *a, **k: calls.append("padded") or pack_batch_sequences(*a, **k))
    batch = collator(examples)
    assert calls == []  # the per-sample route was taken

    samples = collator._encode_all(examples)[0]
    longest = max(s["input_ids"].shape[1] for s in samples)
    padded = collator._padded(samples, -(-longest // collator.pad_to_multiple_of) * collator.pad_to_multiple_of)
    reference = collator._pack(padded, collator._per_sample_keys(samples), None)
    assert calls == ["padded"]
    assert set(batch) == set(reference)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(batch[key], reference[key]), key
    assert batch["max_length_q"] == reference["max_length_q"]
    for key in ("cu_seqlens", "cu_seqlens_padded", "seq_lengths"):
        assert torch.equal(batch["vlm_pack"][key], reference["vlm_pack"][key]), key
    assert batch["vlm_pack"]["stats"].padded_slots == batch["input_ids"].numel() - sum(
        s["input_ids"].shape[1] for s in samples)

