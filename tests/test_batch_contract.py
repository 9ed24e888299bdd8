"""The batch contract (vlm_pack.core.batch): every producer's output goes straight into ``model(**batch)``.

* the one bookkeeping entry ``batch["vlm_pack"]`` is inert for every registered family (same logits and loss
  as the batch without it), while the old top-level bookkeeping crashes a Qwen2.5-VL forward;
* the first label of every sample is -100 in every producer, so the model's OWN loss (a whole-row shift)
  equals the per-sample shifted loss; ``packed_cross_entropy`` is unchanged by the rule.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from datasets import Dataset

from vlm_pack.core.batch import METADATA_KEY, model_inputs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.core.loss import packed_cross_entropy
from vlm_pack.models import registered_families
from vlm_pack.offline.dataset import PackedDataset, PackedSFTDataset
from vlm_pack.offline.storage import PackedArrays, build_index, write_packed
from vlm_pack.testing.tiny_families import OWN_PROOF_FAMILIES, TINY_VLM_FAMILIES
from vlm_pack.testing.tiny_models import (
    TINY_FAMILIES, offline_gemma3_processor, qwen_tokenizer, tiny_config, tiny_model,
)

# Gemma 4 has no offline processor: its images are proven in tests/test_gemma4.py, here it runs text-only chats.
VLM_FAMILIES = tuple(f for f in TINY_FAMILIES if hasattr(tiny_config(f), "vision_config") and f != "gemma4")
# Gemma 3 brings its own processor (Qwen tokenizer + Gemma 3 tokens, transformers' Gemma3ImageProcessor).
_gemma3_processor = functools.lru_cache(maxsize=1)(offline_gemma3_processor)


def mixed_examples() -> list[dict]:
    """Images of different sizes (1-3 per sample), an easy-vqa sample and a text-only chat."""
    return photo_examples(2, seed=3, max_side=84) + text_chat_examples(1, seed=3) + easy_vqa_examples(1, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


def family_batch(family: str, processor, tokenizer, **kwargs) -> dict:
    if family in VLM_FAMILIES:
        processor = _gemma3_processor() if family == "gemma3" else processor
        collator = VLMPackingCollator(processor, max_length=512, model_config=tiny_config(family), **kwargs)
        return collator(mixed_examples())
    collator = VLMPackingCollator(tokenizer, max_length=512, model_config=tiny_config(family), **kwargs)
    return collator(text_chat_examples(4, seed=3))


def test_every_registered_family_is_covered():
    # Families built by vlm_pack.testing.tiny_families (and Mistral, Cohere 2, DeepSeek-V3 text, inside Mistral3, Aya Vision,
    # Kimi K2.5) call model(**batch) with the metadata entry in
    # tests/test_vlm_families.py (compare: logits and the model's own loss vs each sample alone).
    # OWN_PROOF_FAMILIES: tests/test_family_<family>.py (the same compare; Gemma 3n's text model through the
    # collator; PaliGemma's own encoder).
    covered = (set(TINY_FAMILIES) | set(TINY_VLM_FAMILIES) | set(OWN_PROOF_FAMILIES)
               | {"mistral", "cohere2", "gemma3n_text", "deepseek_v3"})
    assert {spec.name for spec in registered_families().values()} <= covered


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_metadata_entry_is_inert_for_every_family(family, processor, tokenizer):
    hybrid = "linear_attention" in registered_families()[family].model.layer_kinds  # needs a full-attention layer too
    model = enable_packing(tiny_model(family, layers=2 if hybrid else 1))
    batch = family_batch(family, processor, tokenizer)
    assert set(batch[METADATA_KEY]) == {"cu_seqlens", "cu_seqlens_padded", "seq_lengths", "stats"}
    with torch.no_grad():
        full = model(**batch)
        bare = model(**model_inputs(batch, keep_labels=True))
    assert torch.equal(full.logits, bare.logits) and torch.equal(full.loss, bare.loss)
    # ... and the model's own loss is the exact per-sample token mean (first labels -100, see below)
    expected = packed_cross_entropy(full.logits, batch["labels"], batch["cu_seq_lens_q"])
    torch.testing.assert_close(full.loss, expected, rtol=1e-6, atol=1e-6)


def test_corruption_bookkeeping_at_top_level_crashes_the_vision_tower(processor, tokenizer):
    """The old contract (``cu_seqlens`` & co. next to the forward arguments) breaks Qwen2.5-VL's vision blocks."""
    model = enable_packing(tiny_model("qwen2_5_vl", layers=1))
    batch = family_batch("qwen2_5_vl", processor, tokenizer)
    flat = {**model_inputs(batch, keep_labels=True), **batch[METADATA_KEY]}
    with pytest.raises(RuntimeError, match="split"), torch.no_grad():
        model(**flat)


def _sample_starts(batch: dict) -> torch.Tensor:
    return batch[METADATA_KEY]["cu_seqlens_padded"][:-1]


@pytest.mark.parametrize("cp", [1, 2])
def test_collator_first_label_of_every_sample_is_ignored(cp, processor, tokenizer):
    batch = family_batch("qwen2_vl", processor, tokenizer, context_parallel_size=cp)
    assert torch.all(batch["labels"][0, _sample_starts(batch)] == -100)
    padded = family_batch("qwen2_vl", processor, tokenizer, pack_sequences_in_batch=False)
    assert torch.all(padded["labels"][:, 0] == -100) and padded[METADATA_KEY]["stats"].samples == 4


def test_rule_changes_no_packed_cross_entropy_but_fixes_the_models_own_loss(processor, tokenizer):
    """Undo the rule (first labels = their tokens): packed_cross_entropy is bit-identical, HF's own loss is off."""
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    batch = family_batch("qwen2_vl", processor, tokenizer)
    starts = _sample_starts(batch)
    unmasked = batch["labels"].clone()
    unmasked[0, starts] = batch["input_ids"][0, starts]
    assert torch.any(unmasked != batch["labels"])
    cu = batch["cu_seq_lens_q"]
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
        for reduction in ("token", "sample", "none"):
            assert torch.equal(packed_cross_entropy(logits, unmasked, cu, reduction=reduction),
                               packed_cross_entropy(logits, batch["labels"], cu, reduction=reduction))
        exact = packed_cross_entropy(logits, batch["labels"], cu)
        corrupted = model(**{**model_inputs(batch), "labels": unmasked}).loss
    assert abs(corrupted - exact) / exact > 1e-3  # predicts each next sample's first token from the last one


def test_offline_producers_first_labels_and_inert_metadata(tmp_path, tokenizer):
    lengths = (5, 3, 7, 4)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(10, 5000, n) for n in lengths]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    arrays = PackedArrays(
        index=build_index(np.array([2, 2]), offsets),
        tokens=np.concatenate(tokens),
        loss_mask=np.ones(sum(lengths), dtype=np.uint8),
        seq_offsets=offsets,
        source_index=np.arange(len(lengths)),
    )
    path = write_packed(tmp_path / "training_16.npy", arrays)
    offline = PackedSFTDataset(path, 16, pad_seq_to_mult=2)
    in_memory = PackedDataset(Dataset.from_dict({"input_ids": [t.tolist() for t in tokens]}), tokenizer, 16)
    model = enable_packing(tiny_model("llama", layers=1))
    for batch in (offline.collate_fn([offline[0]]), in_memory.collate([in_memory[0], in_memory[1]])):
        starts = batch["cu_seq_lens_q"][:-1]
        assert torch.all(batch["labels"][0, starts] == -100) and batch["labels"].shape == batch["input_ids"].shape
        with torch.no_grad():
            full = model(**batch)
            bare = model(**model_inputs(batch, keep_labels=True))
        assert torch.equal(full.logits, bare.logits) and torch.equal(full.loss, bare.loss)
        expected = packed_cross_entropy(full.logits, batch["labels"], batch["cu_seq_lens_q"])
        torch.testing.assert_close(full.loss, expected)
