"""`vlm-pack prepare` reads TRL's dataset formats from any file `datasets.load_dataset` reads.

References: the equivalent messages JSONL (prompt-completion and parquet give the very same packs), and TRL's own
``SFTTrainer._prepare_dataset`` (its tokens and labels per sample: string prompt-completion, ``text``, and
conversational prompt-completion whose prompt holds an earlier assistant turn). Each rule has a corruption test.
"""

import json
import types

import datasets
import numpy as np
import pytest
from tokenizers import processors

from vlm_pack.cli.main import main
from vlm_pack.offline import encoding
from vlm_pack.offline.prepare import TokenizerSource, prepare_packed_sequence_data, token_keys
from vlm_pack.offline.encoding import SampleFormat
from vlm_pack.offline.storage import open_packed
from vlm_pack.testing.tiny_models import qwen_tokenizer

PROMPTS = [[{"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(12)]
COMPLETIONS = [[{"role": "assistant", "content": f"It is {2 * i}." + " Sure." * (i % 4)}] for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The small Qwen tokenizer adding a BOS token (as Llama's does): TRL's string formats add special tokens."""
    tok = qwen_tokenizer()
    bos = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    return tok


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _samples(tokenizer, path, root, **kw):
    """prepare -> {input row: (tokens, loss mask)} read back from the written packs."""
    prepare_packed_sequence_data(path, tokenizer, root, [512], tokenizer_name="t", cache_dir=str(root / "cache"),
                                 progress=False, log=lambda _: None, **kw)
    data = open_packed(root / "packed" / "t" / "training_512.npy")
    cuts = data.seq_offsets
    return data, {int(row): (data.tokens[a:b].tolist(), data.loss_mask[a:b].tolist())
                  for row, a, b in zip(data.source_index, cuts[:-1], cuts[1:])}


def _same_packs(a, b):
    for name in ("index", "tokens", "loss_mask", "seq_offsets", "source_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_prompt_completion_and_parquet_give_the_packs_of_the_messages(tmp_path, tokenizer):
    pairs = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]
    messages = _jsonl(tmp_path / "messages.jsonl", [{"messages": p + c} for p, c in zip(PROMPTS, COMPLETIONS)])
    pc = _jsonl(tmp_path / "pc.jsonl", pairs)
    parquet = tmp_path / "pc.parquet"
    datasets.Dataset.from_list(pairs).to_parquet(str(parquet))
    reference, expected = _samples(tokenizer, messages, tmp_path / "m")
    assert all(0 < sum(mask) < len(mask) for _, mask in expected.values())  # assistant turns only
    for name, path in (("pc", pc), ("parquet", parquet)):
        data, _ = _samples(tokenizer, path, tmp_path / name)
        _same_packs(data, reference)
    entry = json.loads((tmp_path / "pc" / "packed" / "t" / "512_metadata.jsonl").read_text().splitlines()[0])
    assert entry["template"] == "chat"


def _trl_samples(tokenizer, rows) -> dict[int, tuple[list, list]]:
    """TRL's own SFTTrainer dataset preparation (tokens and labels) of ``rows``, as a trainer built on them runs it."""
    from trl import SFTConfig, SFTTrainer

    trainer = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=None,
                                    completion_only_loss="prompt" in rows[0] and "completion" in rows[0])
    args = SFTConfig(output_dir="unused", max_length=None, report_to="none", use_cpu=True)
    datasets.disable_progress_bars()
    try:
        out = SFTTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, args, False, None,
                                          "train")
    finally:
        datasets.enable_progress_bars()
    return {i: (r["input_ids"], [int(label != -100) for label in r["labels"]]) for i, r in enumerate(out)}


STRING_PAIRS = [{"prompt": "The sky is", "completion": " blue."},
                {"prompt": "Two plus two is ", "completion": "four"},  # the prompt's last token merges away
                {"prompt": "Say hi", "completion": " hi<|im_end|>"}]  # already ends with EOS: not doubled
TEXTS = [{"text": "The sky is blue."}, {"text": "A longer sentence, with punctuation: yes!"}]
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "Again?"}],  # an earlier assistant turn: context only
               "completion": [{"role": "assistant", "content": "Hello again."}]},
              {"prompt": PROMPTS[0], "completion": COMPLETIONS[0]}]


@pytest.mark.parametrize("rows,template", [(STRING_PAIRS, "prompt_completion"), (TEXTS, "text"),
                                           (CHAT_PAIRS, "chat")], ids=["strings", "text", "conversational"])
def test_formats_equal_trl_sft_trainer(tmp_path, bos_tokenizer, rows, template):
    _, ours = _samples(bos_tokenizer, _jsonl(tmp_path / "d.jsonl", rows), tmp_path)
    assert ours == _trl_samples(bos_tokenizer, rows)
    entry = json.loads((tmp_path / "packed" / "t" / "512_metadata.jsonl").read_text().splitlines()[0])
    assert entry["template"] == template


@pytest.mark.parametrize("rows,planted", [
    (STRING_PAIRS, ("_with_eos", lambda self, text: text)),  # no EOS appended
    (STRING_PAIRS, ("_prompt_completion", lambda self, rows: encoding.SampleEncoder._text(  # labels on the prompt
        types.SimpleNamespace(tokenizer=self.tokenizer, fmt=self.fmt, _with_eos=self._with_eos),
        [{self.fmt.text_field: r[self.fmt.prompt_field] + r[self.fmt.completion_field]} for r in rows]))),
    (CHAT_PAIRS, ("_completion_only", lambda mask, turns: mask)),  # the prompt's assistant turn labelled
], ids=["no-eos", "prompt-labelled", "prompt-assistant-labelled"])
def test_corruption_is_caught_by_the_trl_comparison(tmp_path, bos_tokenizer, monkeypatch, rows, planted):
    name, bug = planted
    target = encoding if name == "_completion_only" else encoding.SampleEncoder
    monkeypatch.setattr(target, name, bug)
    _, ours = _samples(bos_tokenizer, _jsonl(tmp_path / "d.jsonl", rows), tmp_path)
    assert ours != _trl_samples(bos_tokenizer, rows)


def test_every_file_type_gives_the_same_packs(tmp_path, tokenizer):
    rows = STRING_PAIRS * 3
    reference, _ = _samples(tokenizer, _jsonl(tmp_path / "d.jsonl", rows), tmp_path / "jsonl")
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.to_pandas().to_csv(tmp_path / "d.tsv", sep="\t", index=False)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))  # a JSON array
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow")).rename(tmp_path / "d.arrow")
    for path in (tmp_path / "d.parquet", tmp_path / "d.csv", tmp_path / "d.tsv", tmp_path / "d.json", arrow):
        data, _ = _samples(tokenizer, path, tmp_path / path.suffix[1:])
        _same_packs(data, reference)


def test_the_cache_key_holds_the_content_and_the_format(tmp_path, tokenizer):
    rows = [{"prompt": "a", "completion": "b", "answer": "c"}]
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    source = TokenizerSource(tokenizer)
    keys = {token_keys(path, source, fmt)["training"] for path in (jsonl, parquet)
            for fmt in (SampleFormat(), SampleFormat(completion_field="answer"), SampleFormat(template="text"))}
    assert len(keys) == 6
    logs = []
    for run in range(2):
        prepare_packed_sequence_data(jsonl, tokenizer, tmp_path / str(run), [64], cache_dir=str(tmp_path / "cache"),
                                     progress=False, completion_field="answer", log=logs.append)
    assert sum("from the cache" in line for line in logs) == 1


@pytest.mark.parametrize("rows,match", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}],
     r"d.jsonl, line 2: missing field 'completion' \(present: answer, prompt\); name the right field with "
     r"--completion-field"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": " "}],
     r"d.jsonl, line 2: empty response in field 'completion'; fill or drop"),
    ([CHAT_PAIRS[1], {"prompt": PROMPTS[0], "completion": "plain"}],
     r"d.jsonl, line 2: field 'completion' must be a list of messages .* give every record the same format"),
    ([CHAT_PAIRS[1], {"prompt": PROMPTS[0], "completion": PROMPTS[0]}],
     r"d.jsonl, line 2: field 'completion' has no assistant message"),
    ([{"text": "a"}, {"text": 3}], r"d.jsonl, line 2: field 'text' must be a string, got int"),
    ([{"question": "a", "answer": "b"}], r"d.jsonl, line 1: no known dataset format \(present: answer, question\)"),
])
def test_bad_records_name_the_line_the_field_and_the_fix(tmp_path, tokenizer, rows, match):
    with pytest.raises(ValueError, match=match):
        _samples(tokenizer, _jsonl(tmp_path / "d.jsonl", rows), tmp_path)


def test_bad_table_rows_and_files_are_named(tmp_path, tokenizer):
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 2 + [{"prompt": "a", "completion": ""}]
                               ).to_parquet(str(parquet))
    with pytest.raises(ValueError, match=r"d.parquet, row 2: empty response in field 'completion'"):
        _samples(tokenizer, parquet, tmp_path)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError, match=r"broken.parquet: cannot read it as a parquet file"):
        _samples(tokenizer, broken, tmp_path)


def test_help_says_what_the_code_does(capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ChatML" not in text and "the tokenizer's own template" in text
    for word in ("parquet", "--completion-field", "--text-field", "prompt_completion"):
        assert word in text


def test_a_multi_turn_completion_has_every_assistant_turn_labelled(tmp_path, tokenizer):
    """Conversational prompt-completion whose completion holds two assistant turns (and a user turn between):
    both completion answers are labelled, the prompt's assistant turn and every user turn are not."""
    row = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Again?"}],
           "completion": [{"role": "assistant", "content": "Hello again."}, {"role": "user", "content": "Bye?"},
                          {"role": "assistant", "content": "Bye."}]}
    _, ours = _samples(tokenizer, _jsonl(tmp_path / "d.jsonl", [row]), tmp_path)
    tokens, mask = map(np.asarray, ours[0])
    assert tokens.tolist() == tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                                            return_dict=True)["input_ids"]
    runs = np.split(tokens[mask.astype(bool)], np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    assert [tokenizer.decode(run) for run in runs] == ["Hello again.<|im_end|>\n",
                                                      "<think>\n\n</think>\n\nBye.<|im_end|>\n"]
