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


def _trainer_namespace(processor) -> dict:
    from datasets import Dataset

    from vlm_pack.data import easy_vqa_examples, photo_examples, text_chat_examples
    from vlm_pack.tiny_models import qwen_tokenizer, tiny_model

    tokenizer = qwen_tokenizer()
    examples = photo_examples(4, seed=2, max_side=84) + easy_vqa_examples(2, seed=2) + text_chat_examples(2, seed=2)
    ids = [tokenizer(e["messages"][-1]["content"])["input_ids"] for e in text_chat_examples(8, seed=2)]
    return {"model": tiny_model("qwen2_5_vl", layers=1), "llm": tiny_model("llama", layers=1), "processor": processor,
            "tokenizer": tokenizer, "examples": examples, "tokenized_dataset": Dataset.from_dict({"input_ids": ids})}


def _weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_section_trains(processor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = _trainer_namespace(processor)
    before = _weights(namespace["model"]), _weights(namespace["llm"])
    exec(block("Trainer(model=model, args=args"), namespace)
    for model, old in zip((namespace["model"], namespace["llm"]), before):
        assert any(not torch.equal(a, b) for a, b in zip(old, model.parameters()))  # both trained 2 steps
    assert namespace["model"].accepts_loss_kwargs  # Qwen2.5-VL's class flag overridden by enable_packing


def test_trl_section_trains(processor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = _trainer_namespace(processor)
    setup = block("Trainer(model=model, args=args")  # defines collator and packed, as a reader following along
    exec(setup.split("args = TrainingArguments")[0] + "packed = PackedDataset(tokenized_dataset, tokenizer, 4096)",
         namespace)
    before = _weights(namespace["model"]), _weights(namespace["llm"])
    exec(block("SFTTrainer("), namespace)
    for model, old in zip((namespace["model"], namespace["llm"]), before):
        assert any(not torch.equal(a, b) for a, b in zip(old, model.parameters()))


def test_preference_section_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block("PackedDPOTrainer("), namespace)
    logps = namespace["trainer"].last_logps
    assert logps.chosen.shape == logps.rejected.shape == (2,)
    assert torch.isfinite(logps.chosen).all() and namespace["trainer"].state.global_step == 1


def test_supported_families_table_lists_every_registered_family_with_its_proof():
    from vlm_pack.models import registered_families

    section = README.split("### Supported model families", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and "(`" in line.split("|")[1] and "`model_type`" not in line]
    listed = set(re.findall(r"`([a-z0-9_]+)`", " ".join(row.split("|")[1] for row in rows)))
    registered = registered_families()
    assert {t for spec in registered.values() for t in spec.model_types} >= listed
    assert set(registered) <= listed, f"families missing from the README table: {set(registered) - listed}"
    root = Path(__file__).resolve().parents[1]
    for spec in registered.values():
        assert (root / spec.proof).is_file(), spec.proof
        assert any(spec.proof in row for row in rows if f"`{spec.name}`" in row), f"{spec.name}: proof not linked"
