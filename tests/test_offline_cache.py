"""`prepare`'s token cache is keyed on content (not path + mtime) and a warm re-run needs no tokenizer."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from vlm_pack.offline import prepare
from vlm_pack.offline.prepare import prepare_packed_sequence_data
from vlm_pack.offline.storage import open_packed
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sft_sample.jsonl"
RECORDS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
TOKENIZER = str(qwen_tokenizer_path())


class LoadCounter:
    """Counts how often prepare had to load (i.e. tokenise with) the tokenizer."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = prepare.TokenizerSource.load

        def load(source):
            self.calls += 1
            return original(source)

        monkeypatch.setattr(prepare.TokenizerSource, "load", load)


def _run(path, root, tokenizer=TOKENIZER, **kw):
    return prepare_packed_sequence_data(path, tokenizer, root, [2048], tokenizer_name="t", overwrite=True,
                                        cache_dir=str(root / "cache"), progress=False, log=lambda _: None, **kw)


def _tokens(written):
    data = open_packed(written[0].path)
    return np.asarray(data.tokens).tolist()


def test_edited_file_with_restored_mtime_is_retokenised(tmp_path, monkeypatch):
    loads = LoadCounter(monkeypatch)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:8]))
    first = _tokens(_run(path, tmp_path))
    stat = path.stat()
    edited = [dict(r) for r in RECORDS[:8]]
    edited[2]["response"] = edited[2]["response"][::-1]  # same size, other content
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # what cp -p / rsync -a / tar do
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size
    second = _tokens(_run(path, tmp_path))
    fresh = _tokens(_run(path, tmp_path / "fresh"))  # an independent run on the edited file, own cache
    assert loads.calls == 3  # the edited content was tokenised again
    assert second == fresh != first


def test_everything_that_changes_tokens_is_in_the_key(tmp_path, monkeypatch):
    loads = LoadCounter(monkeypatch)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:6]))
    tok = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tok)
    _run(path, tmp_path, tokenizer=tok)
    _run(path, tmp_path, tokenizer=tok)
    assert loads.calls == 1  # a plain re-run is a cache hit
    _run(path, tmp_path, tokenizer=tok, max_seq_length=64)
    assert loads.calls == 2
    _run(path, tmp_path, tokenizer=tok, template="chat")
    assert loads.calls == 3
    config = tok / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length"', '"model_max_length_changed_by_test": 1, '
                                                                        '"model_max_length"'))
    _run(path, tmp_path, tokenizer=tok)  # tokenizer files changed (same folder path)
    assert loads.calls == 4


def test_warm_rerun_imports_neither_transformers_nor_torch(tmp_path):
    """The CLI on a warm cache: only hashing, packing and writing (measured in benchmarks/prepare_rerun.py)."""
    args = ["prepare", "--input", str(SAMPLE), "--tokenizer", TOKENIZER, "--output-dir", str(tmp_path),
            "--pack-sizes", "2048", "--cache-dir", str(tmp_path / "cache"), "--overwrite", "--no-progress"]
    code = ("import sys; from vlm_pack.cli.main import main; code = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'numba') if m in sys.modules)); "
            "sys.exit(code)")
    prepare_packed_sequence_data(SAMPLE, TOKENIZER, tmp_path / "cold", [2048], cache_dir=str(tmp_path / "cache"),
                                 progress=False, log=lambda _: None)  # warms the cache (in this process)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "from the cache" in run.stdout and run.stdout.strip().endswith("[]")  # warm: nothing heavy imported


def test_num_proc_says_when_it_cannot_help(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:10]))
    lines = []
    prepare_packed_sequence_data(path, TOKENIZER, tmp_path, [2048], tokenizer_name="t", num_proc=4,
                                 cache_dir=str(tmp_path / "cache"), progress=False, log=lines.append)
    note = next(line for line in lines if "--num-proc 4" in line)
    assert "already encodes every batch on all" in note and "tokenising in this process" in note


def test_pack_assignments_are_cached_per_lengths_settings_and_code(tmp_path, monkeypatch):
    from vlm_pack.offline import cache as cache_module
    from vlm_pack.offline.cache import TokenCache, packs_key
    from vlm_pack.offline.encoding import TokenizedSplit

    lengths = np.array([5, 3, 7, 2, 6, 4], dtype=np.int64)
    samples = TokenizedSplit(np.arange(lengths.sum(), dtype=np.int32), np.ones(lengths.sum(), np.uint8),
                             np.concatenate(([0], np.cumsum(lengths))), np.arange(6))
    base = packs_key(lengths, 10, "best_fit_decreasing", 0, 1)
    variants = [packs_key(lengths + 1, 10, "best_fit_decreasing", 0, 1),
                packs_key(lengths, 12, "best_fit_decreasing", 0, 1),
                packs_key(lengths, 10, "first_fit_shuffle", 0, 1),
                packs_key(lengths, 10, "best_fit_decreasing", 1, 1),
                packs_key(lengths, 10, "best_fit_decreasing", 0, 2)]
    assert len({base, *variants}) == 6
    store = TokenCache(tmp_path)
    fresh, _ = prepare.pack_split(samples, 10)
    first, _ = prepare.pack_split(samples, 10, cache=store)
    monkeypatch.setattr(prepare, "pack_lengths", lambda *a: pytest.fail("packed again"))
    again, _ = prepare.pack_split(samples, 10, cache=store)  # from the cache
    for name in ("index", "tokens", "seq_offsets", "source_index"):
        assert np.array_equal(getattr(fresh, name), getattr(again, name)) and np.array_equal(
            getattr(first, name), getattr(again, name))
    monkeypatch.setattr(cache_module, "CACHE_VERSION", "other")  # stands for any change of the packing code
    assert packs_key(lengths, 10, "best_fit_decreasing", 0, 1) != base


def _cache_entries(root):
    return [p for p in (root / "cache" / "prepare").iterdir() if p.is_dir() and p.name != "packs"]


@pytest.mark.parametrize("target", ["tokens", "loss_mask", "info"])
def test_a_corrupted_token_cache_entry_is_named_and_rebuilt(tmp_path, target):
    """One flipped byte in a cached array (or a key missing from info.json) must not reach new packs: the entry
    is named in the log, tokenised again, and the packs equal a cache-less run's."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:12]))
    expected = _tokens(_run(path, tmp_path / "clean"))
    mask_expected = np.asarray(open_packed(tmp_path / "clean" / "packed" / "t" / "training_2048.npy").loss_mask)
    _run(path, tmp_path)
    (entry,) = _cache_entries(tmp_path)
    if target == "info":
        info = json.loads((entry / "info.json").read_text())
        del info["num_dropped"]
        (entry / "info.json").write_text(json.dumps(info))
    else:
        raw = bytearray((entry / f"{target}.npy").read_bytes())
        raw[-3] ^= 0x01  # one bit of one value (a token id; a 0/1 mask value becomes 1/0)
        (entry / f"{target}.npy").write_bytes(bytes(raw))
    lines = []
    written = prepare_packed_sequence_data(path, TOKENIZER, tmp_path / "new", [2048], tokenizer_name="t",
                                           cache_dir=str(tmp_path / "cache"), progress=False, log=lines.append)
    assert any(f"token cache entry {entry} is unusable" in line for line in lines), lines
    assert _tokens(written) == expected
    assert np.array_equal(np.asarray(open_packed(written[0].path).loss_mask), mask_expected)
    assert main_verify(written[0].path.parent) == 0


def main_verify(folder) -> int:
    from vlm_pack.cli.main import main

    return main(["verify", str(folder)])


@pytest.mark.parametrize("damage", ["zeroed", "flipped", "swapped"])
def test_a_corrupted_pack_assignment_cache_is_named_and_repacked(tmp_path, damage):
    from vlm_pack.offline.cache import TokenCache
    from vlm_pack.offline.encoding import TokenizedSplit

    lengths = np.array([5, 3, 7, 2, 6, 4], dtype=np.int64)
    samples = TokenizedSplit(np.arange(lengths.sum(), dtype=np.int32), np.ones(lengths.sum(), np.uint8),
                             np.concatenate(([0], np.cumsum(lengths))), np.arange(6))
    store = TokenCache(tmp_path)
    fresh, _ = prepare.pack_split(samples, 10)
    prepare.pack_split(samples, 10, cache=store)
    (cached,) = (tmp_path / "prepare" / "packs").glob("*.npy")
    bins = np.load(cached)
    if damage == "zeroed":
        bins[:] = 0  # every sample in pack 0: a pack of 27 tokens for size 10
    elif damage == "flipped":
        bins[[0, 1]] = bins[[1, 0]]  # samples of 5 and 3 tokens trade packs: one overfills
    else:
        bins[[1, 3]] = bins[[3, 1]]  # samples of 3 and 2 tokens trade packs: a valid packing, only the checksum tells
        assert bins[1] != bins[3] and np.bincount(bins, weights=lengths).max() <= 10
    np.save(cached, bins)
    lines = []
    again, _ = prepare.pack_split(samples, 10, cache=store, log=lines.append)
    assert lines == [f"pack-assignment cache {cached} is corrupt (sha256 or packing check failed); packing again"]
    for name in ("index", "tokens", "seq_offsets", "source_index"):
        assert np.array_equal(getattr(fresh, name), getattr(again, name))


def test_an_inconsistent_token_cache_entry_is_not_trusted(tmp_path):
    """An entry whose arrays disagree (offsets past the tokens) but whose checksums match what was written."""
    from vlm_pack.offline.cache import TokenCache
    from vlm_pack.offline.encoding import TokenizedSplit

    store = TokenCache(tmp_path)
    good = TokenizedSplit(np.arange(10, dtype=np.int32), np.ones(10, np.uint8), np.array([0, 4, 10]), np.arange(2))
    bad = TokenizedSplit(np.arange(10, dtype=np.int32), np.ones(10, np.uint8), np.array([0, 4, 12]), np.arange(2))
    store.store("good", good, {"template": "chat"})
    store.store("bad", bad, {"template": "chat"})
    lines = []
    assert store.load("good", lines.append) is not None and not lines
    assert store.load("bad", lines.append) is None
    assert lines and "offsets.npy: offsets do not tile the tokens" in lines[0]
