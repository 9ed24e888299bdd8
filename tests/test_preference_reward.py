"""Packed reward modelling equals TRL's own unpacked ``RewardTrainer``: per-sequence scores, the pairwise loss (with
margins and ``center_rewards_coefficient``) and the gradients of one optimizer step under gradient accumulation 2,
for every family with a sequence-classification head in transformers (``AutoModelForSequenceClassification``): Llama,
Qwen2, Qwen3, Mistral, Gemma 3 (``Gemma3ForSequenceClassification``), Qwen3.5 (composite and text) and Qwen3-Next, on
text pairs. TRL 1.16's ``RewardTrainer`` is text-only: its collator takes token ids, and a VLM processor fails in
its constructor (measured with Gemma 3's: ``AttributeError: 'Gemma3Processor' object has no attribute
'pad_token'``), so no VLM reference exists there; the other registered VLMs have no sequence-classification class.
"""

from __future__ import annotations

import functools

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from preference_helpers import _WORDS, TOLERANCE, GradientsAtStep, pair_examples, relative_l2, word_tokenizer
from vlm_pack.core.batch import METADATA_KEY
from vlm_pack.preference import PackedRewardTrainer, RewardCollator, sequence_scores
from vlm_pack.testing.tiny_families import mistral_text_config
from vlm_pack.testing.tiny_models import tiny_config
from version_gates import require_proven

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_5", "qwen3_5_text", "qwen3_next")
HYBRID = ("qwen3_5", "qwen3_5_text", "qwen3_next")  # 2 layers: a linear-attention and a full-attention one


def reward_model(family: str):
    """``family``'s tiny model (1 layer; :data:`HYBRID`: 2) with its sequence-classification head, on the word
    tokenizer's vocabulary."""
    vocab, layers = len(_WORDS.split()), 2 if family in HYBRID else 1
    config = mistral_text_config(vocab, layers=1) if family == "mistral" else tiny_config(family, layers=layers)
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        part.vocab_size = vocab
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def run(family: str, packed: bool, tmp: str):
    tokenizer = word_tokenizer()
    examples = [{**e, "margin": 0.25 * i} for i, e in enumerate(pair_examples(images=False))]
    args = RewardConfig(
        output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, optim="sgd",
        learning_rate=0.1, max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        center_rewards_coefficient=0.01, max_length=None,
    )
    grads = GradientsAtStep()
    kwargs = dict(model=reward_model(family), args=args, train_dataset=datasets.Dataset.from_list(examples),
                  processing_class=tokenizer, callbacks=[grads])
    if packed:
        trainer = PackedRewardTrainer(data_collator=RewardCollator(tokenizer.pad_token_id), **kwargs)
    else:
        trainer = RewardTrainer(**kwargs)
    trainer.train()
    return trainer, grads.grads, trainer.state.log_history[0]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reward"))


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_step_equals_trl(family, tmp, one_thread):
    require_proven(family)
    (reference, ref_grads, ref_logs), (packed, grads, logs) = run(family, False, tmp), run(family, True, tmp)
    for key in ("loss", "margin", "accuracy", "min_reward", "mean_reward", "max_reward"):
        assert abs(logs[key] - ref_logs[key]) <= TOLERANCE * max(1.0, abs(ref_logs[key])), key
    assert relative_l2(grads, ref_grads) < TOLERANCE
    # Per-sequence scores after the step: the stock model's own pooling on TRL's padded batch vs the packed row.
    rows = [reference.train_dataset[i] for i in range(3)]
    with torch.no_grad():
        trl_scores = reference.model(**reference.data_collator(rows)).logits.view(2, -1).T.reshape(-1)
        ours = sequence_scores(packed.model, packed.data_collator(rows)).reshape(-1)
    assert float((ours - trl_scores).abs().max()) <= TOLERANCE * max(1.0, float(trl_scores.abs().max()))


def test_corruption_score_at_row_end_fails(tmp, one_thread):
    """Scoring each sequence one slot early (a pooling index off by one at every boundary) breaks the equality."""
    reference, packed = run("llama", False, tmp)[0], run("llama", True, tmp)[0]
    rows = [reference.train_dataset[i] for i in range(3)]
    batch = packed.data_collator(rows)
    layout = dict(batch[METADATA_KEY]["reward"])
    layout["score_index"] = layout["score_index"] - 1
    batch[METADATA_KEY] = {**batch[METADATA_KEY], "reward": layout}
    with torch.no_grad():
        trl_scores = reference.model(**reference.data_collator(rows)).logits.view(2, -1).T.reshape(-1)
        ours = sequence_scores(packed.model, batch).reshape(-1)
    assert float((ours - trl_scores).abs().max()) > 1e-3


def test_refusals(tmp):
    with pytest.raises(ValueError, match="RewardCollator"):
        PackedRewardTrainer(model=reward_model("llama"),
                            args=RewardConfig(output_dir=tmp, use_cpu=True, report_to="none"),
                            train_dataset=datasets.Dataset.from_list(pair_examples(images=False)),
                            processing_class=word_tokenizer())
    with pytest.raises(ValueError, match="rejected_ids"):
        RewardCollator(0)([{"chosen_ids": [1, 2], "rejected_ids": []}])
    from vlm_pack.testing.tiny_models import tiny_model

    # Every registered family with a sequence-classification class is proven; a VLM's own model is not.
    unproven = tiny_model("qwen2_vl", layers=1)
    unproven.config.num_labels = 1  # past TRL's own num_labels check, to ours
    with pytest.raises(ValueError, match=r"PackedRewardTrainer with a qwen2_vl model: reward modelling .* not proven"):
        PackedRewardTrainer(model=unproven, args=RewardConfig(output_dir=tmp, use_cpu=True, report_to="none"),
                            data_collator=RewardCollator(0), processing_class=word_tokenizer(),
                            train_dataset=datasets.Dataset.from_list(pair_examples(images=False)))


def test_pad_equal_to_eos_scores_the_last_non_pad_token():
    """TRL 1.16's RewardTrainer pads with eos when the tokenizer has no pad token and appends eos to plain-text
    pairs, so pad == eos is common: the stock model's pooling then scores each sequence at its last non-eos token.
    Packed scores equal each sequence run alone through the stock model (scoring a trailing eos would not)."""
    from vlm_pack import enable_packing

    eos = word_tokenizer().convert_tokens_to_ids("<|im_end|>")
    sequences = [[1, 3, 5, 6, eos], [1, 4, 7, eos, 9, 10, eos], [1, 8, 12, 13, 14, 15]]
    reference, packed = reward_model("llama"), enable_packing(reward_model("llama"))
    for model in (reference, packed):
        model.config.pad_token_id = eos
    examples = [{"chosen_ids": sequences[0], "rejected_ids": sequences[1]},
                {"chosen_ids": sequences[2], "rejected_ids": sequences[0][:-1]}]
    with torch.no_grad():
        ours = sequence_scores(packed, RewardCollator(eos)(examples)).reshape(-1)
        alone = torch.cat([reference(input_ids=torch.tensor([ids])).logits.reshape(-1)
                           for e in examples for ids in (e["chosen_ids"], e["rejected_ids"])])
        at_row_end = torch.cat([reference.score(reference.model(input_ids=torch.tensor([ids])).last_hidden_state)[0, -1]
                                for ids in sequences[:2]])
    assert float((ours - alone).abs().max()) <= TOLERANCE * max(1.0, float(alone.abs().max()))
    assert float((at_row_end - alone[:2]).abs().min()) > 1e-3  # the data tells the two pooling slots apart


def test_batches_are_never_dispatched(tmp):
    """accelerate's dispatch_batches (its default for a streamed train or eval set) slices packed rows along dim 0:
    the trainer turns it off on the accelerator it built, and an explicit True is refused."""
    kwargs = dict(model=reward_model("llama"), train_dataset=datasets.Dataset.from_list(pair_examples(images=False)),
                  processing_class=word_tokenizer(), data_collator=RewardCollator(0))
    trainer = PackedRewardTrainer(args=RewardConfig(output_dir=tmp, use_cpu=True, report_to="none"), **kwargs)
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    assert trainer.args.accelerator_config.dispatch_batches is False
    with pytest.raises(ValueError, match="PackedRewardTrainer: dispatch_batches=True cuts packed batches apart"):
        PackedRewardTrainer(args=RewardConfig(output_dir=tmp, use_cpu=True, report_to="none",
                                              accelerator_config={"dispatch_batches": True}), **kwargs)
