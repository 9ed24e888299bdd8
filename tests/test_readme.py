"""The README's Python quick starts run as written (on tiny models and the shipped data)."""

import re
from pathlib import Path

import torch

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def block(containing: str) -> str:
    """The one README python block containing ``containing``."""
    matches = [s for s in SNIPPETS if containing in s]
    assert len(matches) == 1, f"README has {len(matches)} python blocks containing {containing!r}"
    return matches[0]


def test_vlm_quick_start_trains(processor):
    from vlm_pack.data import photo_examples
    from vlm_pack.tiny_models import tiny_model

    model = tiny_model("qwen2_vl")
    namespace = {"model": model, "processor": processor, "examples": photo_examples(4, seed=3)}
    exec(block("packed_cross_entropy(logits, batch"), namespace)
    assert torch.isfinite(namespace["loss"]) and namespace["loss"] > 0
    assert "attention_mask" not in namespace["batch"]
    assert any(p.grad is not None for p in model.parameters())


def test_core_quick_start_runs():
    from vlm_pack.hf import enable_packing
    from vlm_pack.tiny_models import qwen_tokenizer, tiny_model

    tok = qwen_tokenizer()
    enc = tok(["a short one", "a somewhat longer second sample here"], padding=True, return_tensors="pt")
    model = enable_packing(tiny_model("llama"))
    namespace = {"model": model, "tok": tok, "input_ids": enc["input_ids"], "labels": enc["input_ids"].clone(),
                 "attention_mask": enc["attention_mask"]}
    exec(block("pack_batch_sequences(input_ids"), namespace)
    assert namespace["logits"].shape[1] == namespace["packed"].tokens.shape[1]
    assert namespace["params"].cu_seqlens_q_padded is not None  # pad_multiple(cp=2) aligned the sequences


def test_token_budget_quick_start_serves_fixed_width_packs(processor):
    from vlm_pack import VLMPackingCollator
    from vlm_pack.data import easy_vqa_examples, photo_examples
    from vlm_pack.tiny_models import tiny_model

    namespace = {"VLMPackingCollator": VLMPackingCollator, "processor": processor, "model": tiny_model("qwen2_vl"),
                 "examples": photo_examples(3, seed=1) + easy_vqa_examples(3, seed=1)}
    exec(block("TokenBudgetPackDataset(examples"), namespace)
    rows = list(namespace["loader"])
    assert len(rows) == namespace["plan"].num_packs >= 1
    assert all(row["input_ids"].shape == (1, 4096) for row in rows)
