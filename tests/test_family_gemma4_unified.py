"""Gemma 4 unified (encoder-free patch embedder + Gemma 4 text, image blocks on every layer) exact under packing
(issue 47).

Same proof as the harness of tests/test_vlm_families.py: the edge micro-batch (system prompts, a one-word answer, an
image inside an assistant turn, text-only, images of different sizes, a multi-image sample) packed through
``enable_packing`` + ``VLMPackingCollator`` against each sample run ALONE through the stock transformers model
(``attn_implementation="sdpa"``, fp32 CPU): logits and per-sample losses within the measured fp32 noise floor, the
model's own loss equal to the per-sample token mean, gradients within ``GRAD_REL_L2`` (tests/tolerance.py); one
corruption per family rule that must break the comparison. Token-budget plans equal the processor's lengths in
tests/test_budget_packs.py.

Tiny models and offline processors: ``vlm_pack/testing/families/gemma4_unified.py``
(via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["gemma4_unified"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["gemma4_unified"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["gemma4_unified"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_gemma4_unified_each_rule_is_needed(monkeypatch):
    """Each Gemma 4 unified rule dropped breaks the comparison the clean edge batch passes: image blocks made causal;
    blocks on the sliding layers only (Gemma 4's own rule); the sliding window dropped; the swapped images of two
    samples (same size)."""
    from vlm_pack.integrations import hf_model

    setup = families.setup_for("gemma4_unified")
    examples = families.edge_examples()
    batch, refs = families.exact_batch(setup, examples)
    lengths = families.packing_metadata(batch)["seq_lengths"].tolist()
    assert max(lengths) > setup.packed.config.text_config.sliding_window  # the window bites
    plain = hf_model.varlen_attention
    corruptions = {
        "blocks made causal": lambda *a, **k: plain(*a, **{**k, "block_ids": None}),
        "blocks on sliding layers only": lambda *a, **k: plain(*a, **({**k, "block_ids": None} if k["window"] is None
                                                                      else k)),
        "window dropped": lambda *a, **k: plain(*a, **{**k, "window": None}),
    }
    for name, corrupt in corruptions.items():
        monkeypatch.setattr(hf_model, "varlen_attention", corrupt)
        error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
        print("gemma4_unified", name, error)
        assert refs[3].logits.is_far(error), name
    monkeypatch.undo()
    swap = families.swap_examples()
    swap_batch, swap_refs = families.exact_batch(setup, swap)
    swapped = families.swapped_vision(setup, swap_batch, swap)
    assert swap_refs[3].logits.is_far(families.logit_error(swap_batch, families.packed_logits(setup.packed, swapped),
                                                           swap_refs))


@torch.no_grad()
def test_gemma4_unified_image_longer_than_the_window_is_refused(monkeypatch):
    """The stock sliding layers let an image block see itself past the window, the packed attention does not: an image
    longer than the window is refused by name, not approximated."""
    setup = families.setup_for("gemma4_unified")
    batch = setup.collator(families.edge_examples())
    monkeypatch.setattr(setup.packed.config.text_config, "sliding_window", 40)
    with pytest.raises(ValueError, match=r"an image of 65 tokens > sliding_window=40"):
        families.packed_logits(setup.packed, batch)


def test_labels_are_the_official_templates_answers():
    """Rendered with the official Gemma 4 template (TRL's gemma4_v5; no training variant ships, so no generation
    blocks): each sample's labels are exactly its assistant answers, each closed by the template's ``<turn|>`` and
    newline; the image inside an assistant turn and its markers carry none."""
    setup = families.setup_for("gemma4_unified")
    examples = families.edge_examples()
    tokenizer = setup.processor.tokenizer
    for example in examples:
        labels = setup.collator([example])["labels"][0]
        answers = ["".join(part["text"] for part in turn["content"] if part["type"] == "text")
                   if isinstance(turn["content"], list) else turn["content"]
                   for turn in example["messages"] if turn["role"] == "assistant"]
        assert tokenizer.decode(labels[labels != -100]) == "".join(f"{a.strip()}<turn|>\n" for a in answers)


def test_gemma4_unified_text_model_packed_equals_each_sample_alone():
    """The language model on its own (Gemma4UnifiedForCausalLM, model type gemma4_unified_text): sliding (window 8)
    and full layers, key-equals-value full layers, final logit softcapping; text chats packed with the tokenizer's
    collator against each sample alone through the stock model (logits, losses, the model's own chunked softcapped
    loss, gradients)."""
    from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig

    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.integrations.hf_model import enable_packing
    from vlm_pack.testing.data import text_chat_examples
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    text = families.setup_for("gemma4_unified").stock.config.text_config.to_dict()
    text = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "transformers_version")}

    def model():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = Gemma4UnifiedTextConfig(**{**text, "vocab_size": len(tokenizer), "sliding_window": 8})
            return Gemma4UnifiedForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()

    packed = enable_packing(model())
    collator = VLMPackingCollator(tokenizer, max_length=1024, model_config=packed.config)
    assert collator.family.name == "gemma4_unified" and packed.config.final_logit_softcapping
    setup = families.Setup("gemma4_unified_text", tokenizer, model(), packed, collator)
    examples = text_chat_examples(3, seed=1, max_turns=2)
    assert max(collator([e])["input_ids"].shape[1] for e in examples) > 8  # the window bites
    result = families.compare(setup, examples)
    print("gemma4_unified_text", result)
    families.assert_exact(result)
