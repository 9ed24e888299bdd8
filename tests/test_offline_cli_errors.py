"""`vlm-pack prepare` / `stats`: bad input gives ONE line naming the file/line and the fix (exit 2), no traceback."""

import json
import os
import pathlib
import re

import pytest

from vlm_pack.cli.main import main
from vlm_pack.offline.storage import open_packed
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "sft_sample.jsonl"
GOOD = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:3]]
TOKENIZER = str(qwen_tokenizer_path())


def _prepare(tmp_path, data, *extra, tokenizer=TOKENIZER, out=None):
    return main(["prepare", "--input", str(data), "--tokenizer", str(tokenizer), "--output-dir", str(out or tmp_path),
                 "--pack-sizes", "2048", "--cache-dir", str(tmp_path / "cache"), "--no-progress", *extra])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _lines(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _json(record) -> bytes:
    return json.dumps(record).encode()


@pytest.mark.parametrize(("lines", "match"), [
    ((_json(GOOD[0]), b"", _json(GOOD[1]), b'{"prompt": "caf\xe9", "response": "ok"}'),
     r"bad.jsonl, line 4: not valid UTF-8 \(byte 0xe9 at column 16\); re-encode the file as UTF-8"),
    ((_json(GOOD[0]), b'{"prompt": "a", "response": "b", "prompt": "c"}'),
     r"bad.jsonl, line 2: duplicate key 'prompt' in one JSON object; keep only one"),
    ((b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b', "response": "x"}',),
     r"bad.jsonl, line 1: JSON nested too deeply for the parser"),
    ((b"", b"", _json(GOOD[0]), _json({"prompt": "x"})),  # blank lines count: the file's own line numbers
     r"bad.jsonl, line 4: missing field 'response'"),
])
def test_bad_input_names_the_file_line(tmp_path, capsys, lines, match):
    assert _prepare(tmp_path, _lines(tmp_path / "bad.jsonl", *lines)) == 2
    assert re.search(match, _error(capsys))


def test_utf8_bom_is_accepted_and_messages_are_detected(tmp_path, capsys):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    data = _lines(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + _json(chat), _json(chat))
    assert _prepare(tmp_path, data) == 0  # no --template chat needed
    capsys.readouterr()
    data = open_packed(tmp_path / "packed" / "tokenizer_files" / "training_2048.npy")
    assert data.num_samples == 2


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_tokenizer_that_is_not_a_folder_fails_fast(tmp_path, capsys, kind):
    tokenizer = tmp_path / "no_such_tokenizer"
    if kind == "file":
        tokenizer.write_text("{}")
    assert _prepare(tmp_path, SAMPLE, tokenizer=tokenizer) == 2
    err = _error(capsys)
    state = "does not exist" if kind == "missing" else "is a file"
    assert f"tokenizer {tokenizer} {state}; give a local tokenizer folder" in err


def test_output_dir_that_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "out"
    blocker.write_text("x")
    assert _prepare(tmp_path, SAMPLE, out=blocker) == 2
    assert "is a file, not a folder; choose another --output-dir" in _error(capsys)


def test_seed_out_of_range_fails_before_tokenising(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("vlm_pack.offline.prepare._tokenize", lambda *a: pytest.fail("tokenised before the check"))
    assert _prepare(tmp_path, SAMPLE, "--algorithm", "first_fit_shuffle", "--seed", "-3") == 2
    assert "seed (--seed) must be an integer in [0, 2**64), got -3" in _error(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_output_dir_not_writable(tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    assert _prepare(tmp_path, SAMPLE, out=locked) == 2
    assert "permission denied); choose a writable --output-dir" in _error(capsys)


def test_stats_options_are_checked_before_work(tmp_path, capsys):
    assert main(["stats", str(SAMPLE), "--max-seq-length", "0", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--max-seq-length must be >= 1, got 0" in _error(capsys)
    assert main(["stats", str(SAMPLE), "--plot", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in _error(capsys)
    (tmp_path / "file").write_text("x")
    assert main(["stats", str(SAMPLE), "--plot", str(tmp_path / "file" / "p.png")]) == 2
    assert "cannot write there" in _error(capsys) and not (tmp_path / "p.png").exists()


# ------------------------------------------------------------- issue 20: names, lock, plan.json, full disk, collator


@pytest.mark.parametrize("name", ["../x", "/abs/path", "a/../../b", ".."])
def test_tokenizer_name_cannot_leave_the_output_folder(tmp_path, capsys, name):
    data = _lines(tmp_path / "d.jsonl", *(_json(r) for r in GOOD))
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _prepare(tmp_path, data, "--tokenizer-name", name, out=out) == 2
    err = _error(capsys)
    assert "tokenizer_name (--tokenizer-name)" in err and "must be a plain folder name" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written anywhere


def _lock_target(tmp_path, link: str):
    out = tmp_path / "out" / "packed" / "t"
    out.mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("user data\n")
    if link == "symlink":
        (out / ".vlm_pack.lock").symlink_to(victim)
    else:
        os.link(victim, out / ".vlm_pack.lock")
    return victim


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_lock_never_follows_a_link_or_truncates_a_foreign_file(tmp_path, capsys, link):
    victim = _lock_target(tmp_path, link)
    data = _lines(tmp_path / "d.jsonl", *(_json(r) for r in GOOD))
    assert _prepare(tmp_path, data, "--tokenizer-name", "t", out=tmp_path / "out") == 2
    assert ".vlm_pack.lock" in _error(capsys)
    assert victim.read_text() == "user data\n"


def test_full_disk_names_the_file(tmp_path, capsys, monkeypatch):
    import numpy as np

    data = _lines(tmp_path / "d.jsonl", *(_json(r) for r in GOOD))
    real_save = np.save

    def full(path, *args, **kw):
        if str(path).endswith(".tokens.npy"):
            raise OSError("855120 requested and 464864 written")
        return real_save(path, *args, **kw)

    monkeypatch.setattr(np, "save", full)
    assert _prepare(tmp_path, data, "--tokenizer-name", "t") == 2
    err = _error(capsys)
    assert re.search(r"training_2048\.tokens\.npy: cannot write it \(855120 requested and 464864 written\)", err), err


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    import numpy as np

    from vlm_pack.budget import plan_token_budget_packs
    from vlm_pack.budget.lengths import SampleLengths

    lengths = SampleLengths(np.array([10, 30, 20]), np.zeros(3, np.int64), np.zeros(3, np.int64))
    return plan_token_budget_packs(lengths, 64).save(tmp_path_factory.mktemp("plan") / "plan")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda text: text[:-20], "not valid JSON"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "pack_size"}),
     "field 'pack_size' is None"),
    (lambda text: json.dumps({**json.loads(text), "pack_size": "big"}), "field 'pack_size' is 'big'"),
    (lambda text: json.dumps({**json.loads(text), "dropped": ["x"]}), "field 'dropped'"),
    (lambda text: "[]", "expected a JSON object"),
])
def test_broken_plan_json_is_one_line_naming_the_file(plan_dir, tmp_path, edit, match):
    import shutil

    from vlm_pack.budget import TokenBudgetPlan

    copy = shutil.copytree(plan_dir, tmp_path / "plan")
    (copy / "plan.json").write_text(edit((copy / "plan.json").read_text()))
    with pytest.raises(ValueError, match=re.escape(str(copy)) + ".*" + re.escape(match)) as info:
        TokenBudgetPlan.load(copy)
    assert len(str(info.value).splitlines()) == 1


def test_a_dict_given_to_the_collator_is_a_clear_type_error(collator):
    with pytest.raises(TypeError, match=r"takes a list of examples \(a batch\), got a dict.*collator\(\[example\]\)"):
        collator({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
