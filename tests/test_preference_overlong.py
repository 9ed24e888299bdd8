"""Over-long preference pairs: ``PackedDPOTrainer`` truncates them exactly as TRL's own ``DPOTrainer`` does (loss,
rewards and gradients of one accumulated step equal TRL's, keep_start and keep_end), or drops and counts them
(``overlong="drop"``: equal to TRL on the dataset without them); decided when the trainer is built, errors naming
the dataset row. A collator that ignores the truncation, or cuts the wrong side, fails the comparison."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from trl import DPOTrainer

from preference_helpers import _WORDS, TOLERANCE, GradientsAtStep, pair_examples, relative_l2, word_tokenizer
from test_preference_dpo import dpo_config
from vlm_pack.preference import PackedDPOTrainer, PreferenceCollator
from vlm_pack.testing.tiny_models import tiny_model

# Word-tokenised lengths: prompt 12 tokens; chosen 6, 8, 10, 12; rejected 6, 5, 4, 6; the fifth pair's prompt has
# 19 tokens (TRL drops it under keep_start with max_length=16: its prompt alone fills max_length).
LONG_PROMPT = {**pair_examples(images=False)[0],
               "prompt": [{"role": "user", "content": "What is shown in picture 0 ? " * 2}]}
EXAMPLES = pair_examples(images=False) + [LONG_PROMPT]


def _trainer(tmp, packed: bool, examples=EXAMPLES, collator_kwargs=None, overlong=None, streamed=False, **config):
    model, ref = (tiny_model("llama", layers=1, seed=seed, vocab_size=len(_WORDS.split())) for seed in (0, 1))
    grads = GradientsAtStep()
    dataset = datasets.Dataset.from_list(examples)
    kwargs = dict(model=model, ref_model=ref, args=dpo_config(tmp, **config),
                  train_dataset=dataset.to_iterable_dataset() if streamed else dataset,
                  processing_class=word_tokenizer(),
                  callbacks=[grads])
    if not packed:
        return DPOTrainer(**kwargs), grads
    collator = PreferenceCollator(kwargs["processing_class"], model_config=model.config, **(collator_kwargs or {}))
    extra = {} if overlong is None else {"overlong": overlong}
    return PackedDPOTrainer(data_collator=collator, **kwargs, **extra), grads


def _step(trainer, grads):
    trainer.train()
    return trainer.state.log_history[0], grads.grads


def _assert_equal_runs(ours, reference):
    (logs, grads), (ref_logs, ref_grads) = ours, reference
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert abs(logs[key] - ref_logs[key]) <= TOLERANCE * max(1.0, abs(ref_logs[key])), key
    assert relative_l2(grads, ref_grads) < TOLERANCE


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncated_pairs_train_like_trl(tmp_path, mode, one_thread):
    config = dict(max_length=16, truncation_mode=mode)
    reference = _step(*_trainer(str(tmp_path), False, **config))
    trainer, grads = _trainer(str(tmp_path), True, **config)
    assert len(trainer.train_dataset) == (4 if mode == "keep_start" else 5)  # TRL's own filter, kept
    assert trainer.overlong_dropped == ({"train": 1} if mode == "keep_start" else {})
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[1] == 4 * 16  # every sequence cut to max_length
    _assert_equal_runs(_step(trainer, grads), reference)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """TRL's trainer and ours (max_length=16, keep_start) and 4 tokenised rows, for one-batch loss comparisons."""
    tmp = str(tmp_path_factory.mktemp("overlong"))
    reference, ours = (_trainer(tmp, packed, max_length=16)[0] for packed in (False, True))
    return reference, ours, [ours.train_dataset[i] for i in range(4)]


def _loss(trainer, rows) -> float:
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, trainer.data_collator([dict(r) for r in rows])))


@pytest.mark.parametrize("bug", [None, "no-truncation", "wrong-side"])
def test_corruption_truncation_is_caught_by_the_trl_comparison(untrained, bug, monkeypatch, one_thread):
    reference, ours, rows = untrained
    if bug == "no-truncation":
        monkeypatch.setattr(PreferenceCollator, "_fit", lambda self, pair, where: pair)
    elif bug == "wrong-side":  # keep_end applied although keep_start was asked for
        original = PreferenceCollator._fit

        def wrong_side(self, pair, where):
            other = copy.copy(self)
            other.truncation_mode = "keep_end"
            return original(other, pair, where)

        monkeypatch.setattr(PreferenceCollator, "_fit", wrong_side)
    expected = _loss(reference, [{k: v for k, v in r.items() if k != "vlm_pack_row"} for r in rows])
    error = abs(_loss(ours, rows) - expected)
    assert error <= TOLERANCE * max(1.0, abs(expected)) if bug is None else error > 1e-4


def test_dropped_pairs_are_counted_and_the_rest_trains_like_trl(tmp_path, one_thread):
    kept = [EXAMPLES[i] for i in (0, 1)] * 2  # 18 and 20 tokens fit max_length=20; pairs 2, 3 and 4 do not
    reference = _step(*_trainer(str(tmp_path), False, examples=kept, max_length=None))
    trainer, grads = _trainer(str(tmp_path), True, examples=EXAMPLES[:2] * 2 + EXAMPLES[2:], overlong="drop",
                              max_length=20)
    assert trainer.overlong_dropped == {"train": 3}
    assert sorted(trainer.train_dataset["vlm_pack_row"]) == [0, 1, 2, 3]
    _assert_equal_runs(_step(trainer, grads), reference)


def test_an_untruncatable_pair_is_named_by_its_dataset_row_when_the_trainer_is_built(tmp_path):
    # keep_end with max_length=10: the chosen answers of rows 2 (10 tokens) and 3 (12) would push the whole prompt out
    with pytest.raises(ValueError, match=r"train dataset row 2: a completion alone has 10 tokens >= max_length=10.*"
                                         r"\(2 such pairs\); raise max_length or pass overlong='drop'"):
        _trainer(str(tmp_path), True, max_length=10, truncation_mode="keep_end")
    trainer, _ = _trainer(str(tmp_path), True, max_length=18, truncation_mode="keep_end", overlong="drop")
    assert trainer.overlong_dropped == {"train": 4} and trainer.train_dataset["vlm_pack_row"] == [0]


def test_a_streamed_dataset_names_the_row_at_its_batch(tmp_path):
    trainer, _ = _trainer(str(tmp_path), True, max_length=10, truncation_mode="keep_end", max_steps=1,
                          per_device_train_batch_size=1, gradient_accumulation_steps=3, streamed=True)
    with pytest.raises(ValueError, match=r"dataset row 2: a completion alone has 10 tokens"):
        trainer.train()
    plain = PreferenceCollator(word_tokenizer(), max_length=10, truncation_mode="keep_end")
    pair = {"prompt_ids": [1] * 4, "chosen_ids": [2] * 10, "rejected_ids": [3]}
    with pytest.raises(ValueError, match=r"example 0 of the micro-batch: a completion alone"):
        plain([pair])


def test_refusals_at_construction():
    tokenizer = word_tokenizer()
    with pytest.raises(ValueError, match="keep_end.*cannot be shared"):
        PreferenceCollator(tokenizer, shared_prompts=True, max_length=16, truncation_mode="keep_end")
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        PreferenceCollator(tokenizer, truncation_mode="middle")
    with pytest.raises(ValueError, match="overlong='cut'"):
        PreferenceCollator(tokenizer, overlong="cut")
    collator = PreferenceCollator(tokenizer, max_length=16)
    pair = {"prompt_ids": list(range(12)), "chosen_ids": list(range(12)), "rejected_ids": [1]}
    out = collator([pair])["vlm_pack"]["preference"]
    assert out["completion_lengths"].tolist() == [4, 1]  # keep_start: the chosen answer's end is cut


def test_vision_pairs_are_truncated_like_trls_vision_collator():
    """keep_start on image pairs: the tokens and completion positions of every sequence equal those of TRL's own
    ``DataCollatorForVisionPreference`` with the same ``max_length`` (the prompt, images included, is kept)."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from vlm_pack.core.batch import METADATA_KEY
    from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_config

    processor, examples = offline_qwen2vl_processor(), pair_examples(images=True)[:3]
    ours = PreferenceCollator(processor, model_config=tiny_config("qwen2_vl", layers=1))
    limit = max(ours.sequence_lengths(example)[0] for example in examples) + 2  # every completion is cut
    ours.max_length = limit
    batch = ours(copy.deepcopy(examples))
    theirs = DataCollatorForVisionPreference(processor=processor, max_length=limit)(copy.deepcopy(examples))
    which = batch[METADATA_KEY]["preference"]["sequence_of_target"]
    cu = batch["cu_seq_lens_q"].tolist()
    for s, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        row = (s // 2) + (s % 2) * len(examples)  # TRL: every chosen sequence, then every rejected one
        real = theirs["attention_mask"][row].bool()
        assert batch["input_ids"][0, start:end].tolist() == theirs["input_ids"][row][real].tolist()
        scored = torch.zeros(end - start, dtype=torch.long)
        scored[torch.nonzero(which[start:end] == s).flatten() + 1] = 1  # a slot scores the token after it
        assert scored.tolist() == theirs["completion_mask"][row][real].tolist()
    assert max(b - a for a, b in zip(cu[:-1], cu[1:])) == limit


def test_keep_end_keeps_a_pair_that_fits_whole_and_cuts_only_the_overlong_sequence():
    """keep_end (max_length=10) on a batch with a pair that fits (prompt 4 + 3 / 2) and one that does not (prompt 6
    + 5 / 2): the first pair's sequences are kept whole; of the second, only the chosen sequence (11 tokens) loses
    its first prompt token, the rejected one (8) is whole."""
    collator = PreferenceCollator(word_tokenizer(), max_length=10, truncation_mode="keep_end")
    fits = {"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6, 7], "rejected_ids": [8, 9]}
    over = {"prompt_ids": [11, 12, 13, 14, 15, 16], "chosen_ids": [5, 6, 7, 8, 9], "rejected_ids": [7, 8]}
    batch = collator([fits, over])
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    rows = [batch["input_ids"][0, a:b].tolist() for a, b in zip(cu, cu[1:])]
    assert rows == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [12, 13, 14, 15, 16, 5, 6, 7, 8, 9],
                    [11, 12, 13, 14, 15, 16, 7, 8]]


def test_keep_start_refuses_a_prompt_of_exactly_max_length_and_the_longer_completion_decides():
    """keep_start: a prompt of exactly max_length tokens leaves no completion token (TRL drops it): refused, naming
    the example. A pair is over-long by prompt + its LONGER completion, the rejected one too: with overlong='drop'
    the collator refuses a pair whose rejected completion (not its chosen) passes max_length; with keep_end a
    rejected completion alone filling max_length is refused."""
    tokenizer = word_tokenizer()
    collator = PreferenceCollator(tokenizer, max_length=8)
    with pytest.raises(ValueError, match=r"example 0 of the micro-batch: its prompt alone has 8 tokens >= max_length"):
        collator([{"prompt_ids": list(range(1, 9)), "chosen_ids": [1], "rejected_ids": [2]}])
    assert collator.overlong_problem(8, 1, 1) is not None and collator.overlong_problem(7, 1, 1) is None
    drop = PreferenceCollator(tokenizer, max_length=8, overlong="drop")
    assert drop.overlong_problem(4, 1, 5) is not None and drop.overlong_problem(4, 5, 1) is not None
    assert drop.overlong_problem(4, 1, 4) is None
    with pytest.raises(ValueError, match=r"prompt \+ completion has 9 tokens > max_length=8"):
        drop([{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5], "rejected_ids": [5, 6, 7, 8, 9]}])
    keep_end = PreferenceCollator(tokenizer, max_length=8, truncation_mode="keep_end")
    assert keep_end.overlong_problem(2, 1, 8) is not None and keep_end.overlong_problem(2, 1, 7) is None


def test_dropped_count_adds_trls_own_keep_start_filter_to_ours(tmp_path):
    """overlong='drop' with max_length=19, keep_start: TRL's own filter drops the 19-token prompt, vlm_pack the
    three pairs of 20-24 tokens; overlong_dropped counts all four."""
    trainer, _ = _trainer(str(tmp_path), True, examples=EXAMPLES + [EXAMPLES[0]], overlong="drop", max_length=19)
    assert trainer.overlong_dropped == {"train": 4}
    assert sorted(trainer.train_dataset["vlm_pack_row"]) == [0, 5]  # rows 0 and 5 (the same pair) fit
