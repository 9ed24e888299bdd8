"""Offline data integrity: locked atomic writes, SIGKILL at many points, a reader that refuses altered files, verify."""

import json
import os
import pathlib
import random
import re
import shutil
import signal

import numpy as np
import pytest

from vlm_pack.cli.main import main
from vlm_pack.offline import output, prepare, storage
from vlm_pack.offline.cache import TokenCache
from vlm_pack.offline.dataset import PackedSFTDataset
from vlm_pack.offline.output import LOCK_NAME, OutputLockedError, RunOutput
from vlm_pack.offline.prepare import prepare_packed_sequence_data
from vlm_pack.offline.storage import metadata_path, open_packed, read_metadata, sibling_paths, split_path
from vlm_pack.offline.verify import verify_packed
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "sft_sample.jsonl"
RECORDS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
ARRAYS = ("index", "tokens", "loss_mask", "seq_offsets", "source_index")


@pytest.fixture(scope="module")
def tokenizer():
    return str(qwen_tokenizer_path())  # a folder: hashed in ms (a loaded tokenizer is serialised to be keyed)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:24]))
    val = root / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[24:30]))
    return train, val


def _run(tokenizer, train, root, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("log", lambda _: None)
    kw.setdefault("cache_dir", str(train.parent / "cache"))  # shared by the module: each content tokenised once
    kw.setdefault("tokenizer_name", "t")
    return prepare_packed_sequence_data(train, tokenizer, root, kw.pop("sizes", [1024, 2048]), **kw)


def _snapshot(out_dir):
    """Every split the reader accepts (full checks): name -> arrays and its metadata line."""
    seen = {}
    for index in sorted(out_dir.glob("*_*.npy")):
        if storage.parse_split_path(index) is None:
            continue
        try:
            arrays = open_packed(index).validate(str(index))
        except (OSError, ValueError):
            continue
        seen[index.name] = {name: np.asarray(getattr(arrays, name)).copy() for name in ARRAYS}
    return seen


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- atomic writes, lock, writable check


def test_failed_run_leaves_nothing_and_does_not_block(tmp_path, tokenizer, data):
    train, val = data
    bad_val = tmp_path / "bad_val.jsonl"
    bad_val.write_text(json.dumps({"prompt": "word " * 1500, "response": "ok"}) + "\n")
    with pytest.raises(ValueError, match=r"validation sample 0 .* more than the pack size 1024"):
        _run(tokenizer, train, tmp_path, validation_path=bad_val)
    out_dir = tmp_path / "packed" / "t"
    assert not (tmp_path / "packed").exists()  # the folders and lock file the failed run made are gone again
    _run(tokenizer, train, tmp_path, validation_path=val)  # the re-run is not blocked (no --overwrite needed)
    assert set(_snapshot(out_dir)) == {f"{s}_{n}.npy" for s in ("training", "validation") for n in (1024, 2048)}


def test_failed_overwrite_keeps_old_output(tmp_path, tokenizer, data):
    train, val = data
    _run(tokenizer, train, tmp_path, validation_path=val)
    out_dir = tmp_path / "packed" / "t"
    before = _snapshot(out_dir)
    meta_before = metadata_path(out_dir, 1024).read_text()
    bad_val = tmp_path / "bad_val.jsonl"
    bad_val.write_text(json.dumps({"prompt": "word " * 1500, "response": "ok"}) + "\n")
    with pytest.raises(ValueError, match="more than the pack size"):
        _run(tokenizer, train, tmp_path, validation_path=bad_val, overwrite=True)
    after = _snapshot(out_dir)
    assert after.keys() == before.keys() and all(_same(before[k], after[k]) for k in before)
    assert metadata_path(out_dir, 1024).read_text() == meta_before


def test_concurrent_run_fails_naming_the_lock(tmp_path, tokenizer, data, monkeypatch):
    train, _ = data
    out_dir = tmp_path / "packed" / "t"
    monkeypatch.setattr(prepare.TokenizerSource, "load", lambda self: pytest.fail("tokenised before locking"))
    with RunOutput(out_dir, [1024], overwrite=True):  # another run holds the folder
        with pytest.raises(OutputLockedError, match=rf"another `vlm-pack prepare` \(lock {out_dir / LOCK_NAME} held "
                                                    rf"by pid {os.getpid()}\)"):
            _run(tokenizer, train, tmp_path, cache_dir=str(tmp_path / "cold"))
    assert not list(out_dir.glob("training_*"))


def test_output_folder_checked_before_tokenising(tmp_path, tokenizer, data, monkeypatch):
    train, _ = data
    monkeypatch.setattr(prepare.TokenizerSource, "load", lambda self: pytest.fail("tokenised before the check"))
    blocker = tmp_path / "root_is_a_file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"root_is_a_file is a file, not a folder; choose another "):
        _run(str(qwen_tokenizer_path()), train, blocker, cache_dir=str(tmp_path / "cold"))
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "t").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"is a file, not a folder"):
        _run(str(qwen_tokenizer_path()), train, tmp_path, cache_dir=str(tmp_path / "cold"))


# ---------------------------------------------------------------- SIGKILL at many points


class _Killed(Exception):
    pass


def _fork_prepare(tokenizer, train, val, root, *, kill_at=None, kill_in=None, cache=None, count_ops=False):
    """Run prepare (--overwrite) in a forked child; SIGKILL it at its ``kill_at``-th file operation, or when it
    first calls ``kill_in`` (``(owner, attribute name)``: a stage before any file operation, e.g. tokenising).
    Returns (exit status, number of file operations when ``count_ops``). Every kill point is chosen, never a
    wall-clock time, so the test does the same on a quiet and on a loaded machine."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        status = 0
        try:
            os.close(read_end)
            ops = [0]

            def step(fn):
                def wrapped(*a, **k):
                    ops[0] += 1
                    if kill_at is not None and ops[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*a, **k)
                return wrapped

            if kill_in is not None:
                owner, attribute = kill_in
                setattr(owner, attribute, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
            np.save = step(np.save)
            output.os.replace = step(os.replace)
            pathlib.Path.unlink = step(pathlib.Path.unlink)
            output._fsync = step(output._fsync)
            prepare.write_metadata = step(prepare.write_metadata)
            _run(tokenizer, train, root, validation_path=val, overwrite=True,
                 **({"cache_dir": str(root / cache)} if cache else {}),
                 algorithm="first_fit_shuffle", seed=1)
            os.write(write_end, str(ops[0]).encode())
        except BaseException:
            status = 3
        finally:
            os._exit(status)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    ops = os.read(read_end, 64).decode()
    os.close(read_end)
    return status, int(ops) if count_ops and ops else None


def test_sigkill_at_random_points_never_leaves_accepted_partial_output(tmp_path, tokenizer, data):
    train, val = data
    out_dir = tmp_path / "packed" / "t"
    _run(tokenizer, train, tmp_path, validation_path=val)  # OLD output (first fit), also warms the token cache
    old = _snapshot(out_dir)
    old_files = {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file() and p.name != LOCK_NAME}

    def restore_old():
        for p in out_dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            elif p.name != LOCK_NAME:
                p.unlink()
        for name, content in old_files.items():
            (out_dir / name).write_bytes(content)

    _fork_prepare(tokenizer, train, val, tmp_path)  # NEW settings once: their packs are cached from now on
    restore_old()  # (an up-to-date output would be kept as is: no writes to count or interrupt)
    status, n_ops = _fork_prepare(tokenizer, train, val, tmp_path, count_ops=True)  # uninterrupted NEW run
    assert status == 0 and n_ops > 10
    new = _snapshot(out_dir)
    assert len(new) == 4 and not all(_same(old[k], new[k]) for k in old)  # shuffled first fit packs differently
    rng = random.Random(0)
    kill_points = sorted(rng.sample(range(1, n_ops - 1), 10)) + [n_ops - 1, n_ops]  # + the end of the commit
    # Cold cache: killed while tokenising, and after tokenising before the token cache is written.
    stages = [(prepare, "_tokenize"), (TokenCache, "store")]
    outcomes = set()
    for point in [("stage", stage) for stage in stages] + [("op", k) for k in kill_points]:
        restore_old()
        if point[0] == "op":
            status, _ = _fork_prepare(tokenizer, train, val, tmp_path, kill_at=point[1])
        else:
            status, _ = _fork_prepare(tokenizer, train, val, tmp_path, kill_in=point[1], cache=f"cold{point[1][1]}")
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
        accepted = _snapshot(out_dir)
        for name, arrays in accepted.items():
            is_old, is_new = _same(arrays, old[name]), _same(arrays, new[name])
            assert is_old or is_new, f"killed at {point}: {name} is accepted but neither the old nor the new output"
            outcomes.add("old" if is_old else "new")
            entry = storage.metadata_entry_for(out_dir / name)  # metadata, when there, belongs to these files
            if entry is not None:
                assert entry["num_packs"] == len(arrays["index"])
        assert not any(storage.parse_split_path(p) for p in out_dir.glob("*.npy") if p.name not in accepted)
    assert outcomes == {"old", "new"}  # kills landed before and after the commit
    # A run killed at its first write leaves the old output beside its temporary folder. The next run with the old
    # settings finds that output up to date and keeps it, and still removes the dead run's temporary folder.
    restore_old()
    _fork_prepare(tokenizer, train, val, tmp_path, kill_at=1)
    assert list(out_dir.glob(".prepare-*")) and all(_same(_snapshot(out_dir)[k], old[k]) for k in old)
    _run(tokenizer, train, tmp_path, validation_path=val, overwrite=True)  # no stale lock or temporary folder blocks
    assert not list(out_dir.glob(".prepare-*"))


# ---------------------------------------------------------------- reader integrity and verify


@pytest.fixture
def written(tmp_path, tokenizer, data):
    train, val = data
    _run(tokenizer, train, tmp_path, validation_path=val, sizes=[1024])
    return tmp_path / "packed" / "t", split_path(tmp_path / "packed" / "t", "training", 1024)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int64])
def test_wrong_token_dtype_is_refused(written, dtype):
    _, index = written
    tokens = sibling_paths(index)["tokens"]
    np.save(tokens, np.load(tokens).astype(dtype))
    with pytest.raises(ValueError, match=rf"tokens.npy: tokens must be a 1-D int32 array, found {np.dtype(dtype)}"):
        open_packed(index)


def test_truncated_file_names_itself(written):
    _, index = written
    offsets = sibling_paths(index)["seq_offsets"]
    offsets.write_bytes(offsets.read_bytes()[:-12])
    with pytest.raises(ValueError, match=r"seq_offsets.npy is truncated \(\d+ bytes on disk, \d+ expected\).*"
                                         r"re-run `vlm-pack prepare`"):
        PackedSFTDataset(index, 1024)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("num_packs", 999, "num_packs 999 in the metadata"),
    ("num_samples", 1, "num_samples 1 in the metadata"),
    ("packing_factor", 1.5, "packing_factor 1.5 in the metadata"),
])
def test_metadata_counts_are_cross_checked(written, field, value, match):
    out_dir, index = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    entries[0][field] = value
    storage.write_metadata(meta, entries)
    with pytest.raises(ValueError, match=match):
        open_packed(index)


def test_null_metadata_field_is_refused(written):
    out_dir, index = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    entries[0]["max_samples_per_bin"] = None
    storage.write_metadata(meta, entries)
    with pytest.raises(ValueError, match=r"field 'max_samples_per_bin' is null, not a number.*re-run"):
        PackedSFTDataset(index, 1024, metadata=meta)


def test_moved_interior_offset_is_caught(written, capsys):
    out_dir, index = written
    offsets_path = sibling_paths(index)["seq_offsets"]
    offsets = np.load(offsets_path)
    data = open_packed(index)
    pack = int(np.flatnonzero(data.samples_per_pack() >= 2)[0])
    inner = int(data.index[pack]["sample_start"]) + 1  # a boundary inside the pack
    tampered = offsets.copy()
    tampered[inner] = tampered[inner - 1]  # an empty sample: not monotonic
    np.save(offsets_path, tampered)
    ds = PackedSFTDataset(index, 1024)  # opening stays O(1) ...
    with pytest.raises(ValueError, match=rf"pack {pack} is corrupt"):  # ... reading that pack refuses it
        ds[pack]
    tampered = offsets.copy()
    tampered[inner] += 1  # still monotonic and inside the pack: only the checksum can tell
    np.save(offsets_path, tampered)
    PackedSFTDataset(index, 1024)[pack]
    reports = {r.name: r for r in verify_packed(out_dir)}
    assert any("seq_offsets.npy: sha256 differs" in p for p in reports["training_1024"].problems)
    assert not reports["validation_1024"].problems
    assert main(["verify", str(out_dir)]) == 1
    out = capsys.readouterr().out
    assert "FAIL training_1024" in out and "ok   validation_1024" in out


def test_verify_passes_on_fresh_output(written, capsys):
    out_dir, _ = written
    assert main(["verify", str(out_dir)]) == 0
    assert capsys.readouterr().out.count("checksums match") == 2


def test_dataset_open_skips_the_full_scan_when_metadata_proves_the_fit(written, monkeypatch):
    out_dir, index = written
    scans = []
    monkeypatch.setattr(storage.PackedArrays, "pack_loads", lambda self, m=1: scans.append(m) or np.zeros(0))
    ds = PackedSFTDataset(index, 1024)  # prepare's metadata: packed for 1024 -> no O(samples) scan
    assert not scans and ds.max_samples_per_bin == read_metadata(metadata_path(out_dir, 1024))[0]["max_samples_per_bin"]
    PackedSFTDataset(index, 1024, pad_seq_to_mult=4)  # aligned to 4 was never checked at write time: scanned
    assert scans == [4]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"pack \d+ holds \d+ tokens, more than pack_size=64"):
        PackedSFTDataset(index, 64)  # smaller than written: scanned, refused at open as before
    # altered index, counts unchanged: pack k swallows the first sample of pack k + 1 -> refused when read
    data = open_packed(index)
    table = np.load(index)
    offsets = np.asarray(data.seq_offsets)
    lengths, sizes = np.diff(offsets), table["token_end"] - table["token_start"]
    k = next(k for k in range(len(table) - 1) if table[k + 1]["sample_end"] - table[k + 1]["sample_start"] >= 2
             and sizes[k] + lengths[table[k + 1]["sample_start"]] > 1024)
    moved = table[k + 1]["sample_start"] + 1
    table[k]["sample_end"] = table[k + 1]["sample_start"] = moved
    table[k]["token_end"] = table[k + 1]["token_start"] = offsets[moved]
    np.save(index, table)
    ds = PackedSFTDataset(index, 1024)  # O(1) open cannot see it ...
    with pytest.raises(ValueError, match=rf"pack {k} holds more than pack_size=1024 tokens"):
        ds[k]  # ... reading the pack does


@pytest.mark.parametrize(("field", "value"), [
    ("max_samples_per_bin", 99), ("packing_factor", 1.0), ("packing_efficiency", 12.5),
    ("dataset_max_seqlen", 7), ("min_packed_seqlen", 1), ("num_tokens", 3), ("num_samples", 2),
])
def test_verify_recomputes_every_metadata_statistic(written, field, value, capsys):
    """An edited statistic is caught by `verify` even though the files (and their checksums) are untouched."""
    out_dir, _ = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    entries[0][field] = value
    storage.write_metadata(meta, entries)
    problems = [p for r in verify_packed(out_dir) for p in r.problems]
    # counts the O(1) open already checks are named there; the rest by the recomputation
    assert any(f"field {field!r} is {value!r} but the packs give" in p or f"{field} {value} in the metadata" in p
               for p in problems), problems
    assert main(["verify", str(out_dir)]) == 1


def test_verify_checks_aligned_pack_loads(written):
    """Packs written without alignment but recorded as aligned to 64: some pack overflows once aligned."""
    out_dir, _ = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    entries[0]["pad_seq_to_mult"] = 512
    storage.write_metadata(meta, entries)
    problems = [p for r in verify_packed(out_dir) for p in r.problems]
    assert any("aligned to 512, more than the pack size 1024" in p for p in problems), problems


def test_a_file_longer_than_its_header_is_refused_without_metadata(written):
    """Bytes appended to a companion file: refused by the O(1) open even when no metadata sits next to it."""
    out_dir, index = written
    metadata_path(out_dir, 1024).unlink()
    tokens = sibling_paths(index)["tokens"]
    tokens.write_bytes(tokens.read_bytes() + b"\0" * 8)
    with pytest.raises(ValueError, match=r"tokens.npy is longer than its header says \(\d+ bytes on disk"):
        open_packed(index)


def test_recorded_file_sizes_are_compared_with_the_files(written):
    out_dir, index = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    recorded = entries[0]["files"]["loss_mask"]["bytes"]
    entries[0]["files"]["loss_mask"]["bytes"] = recorded + 1
    storage.write_metadata(meta, entries)
    with pytest.raises(ValueError, match=rf"loss_mask.npy has {recorded} bytes, the metadata records {recorded + 1}"):
        open_packed(index)


@pytest.mark.parametrize(("text", "match"), [
    ('[{"split": "training"', "not valid JSON"),
    ('{"split": "training", "files": 5}', "field 'files' must map each file role"),
])
def test_malformed_metadata_is_one_line_naming_the_file(written, capsys, text, match):
    out_dir, index = written
    metadata_path(out_dir, 1024).write_text(text + "\n")
    with pytest.raises(ValueError, match=re.escape(str(metadata_path(out_dir, 1024))) + ".*" + match):
        open_packed(index)
    assert main(["verify", str(out_dir)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_verify_compares_the_pack_index_checksum(tmp_path, tokenizer, data):
    """One sample moved to the next pack by editing the pack index alone, where every other check still holds
    (each pack fits, every recomputed statistic is unchanged): the index file's sha256 is all that tells."""
    train, _ = data
    size = 1500  # first_fit_shuffle leaves room there to move a sample
    _run(tokenizer, train, tmp_path, sizes=[size], algorithm="first_fit_shuffle")
    out_dir = tmp_path / "packed" / "t"
    index = split_path(out_dir, "training", size)
    table, offsets = np.load(index), np.asarray(open_packed(index).seq_offsets)
    ends = table["sample_end"].copy()

    def loads_counts(ends):
        bounds = np.concatenate(([0], ends))
        return np.diff(offsets[bounds]), np.diff(bounds)

    loads, counts = loads_counts(ends)
    for k, step in ((k, step) for k in range(len(ends) - 1) for step in (-1, 1)):
        moved = ends.copy()
        moved[k] += step
        new_loads, new_counts = loads_counts(moved)
        if (new_counts.min() > 0 and new_loads.max() <= size and new_loads.min() == loads.min()
                and new_counts.max() == counts.max()):
            break
    else:
        pytest.fail("no sample can move between these packs without changing a statistic")
    table["sample_end"][k] = table["sample_start"][k + 1] = moved[k]
    table["token_end"][k] = table["token_start"][k + 1] = offsets[moved[k]]
    np.save(index, table)
    assert PackedSFTDataset(index, size)[k]["input_ids"].shape[0] == new_loads[k]  # read as valid, the sample moved
    problems = [p for r in verify_packed(out_dir) for p in r.problems]
    assert problems == [f"{index}: sha256 differs from the metadata; re-run `vlm-pack prepare`"]


def test_reading_a_pack_checks_its_aligned_load(written):
    """Metadata edited to say the packs were aligned to 16 when written (they were not): the O(1) open trusts it,
    so each pack's load with its samples aligned to 16 is checked as the pack is read: a pack whose aligned
    samples overflow 1024 (though its tokens fit) is refused, one that fits is read."""
    out_dir, index = written
    meta = metadata_path(out_dir, 1024)
    entries = read_metadata(meta)
    for entry in entries:
        entry["pad_seq_to_mult"] = 16
    storage.write_metadata(meta, entries)
    ds = PackedSFTDataset(index, 1024, pad_seq_to_mult=16)  # opened: the metadata vouches for the fit
    table, lengths = np.load(index), np.diff(np.asarray(open_packed(index).seq_offsets))
    aligned = -(-lengths // 16) * 16
    loads = [(int(lengths[s:e].sum()), int(aligned[s:e].sum()))
             for s, e in zip(table["sample_start"], table["sample_end"])]
    fits = next(k for k, (_, load) in enumerate(loads) if load <= 1024)
    over = next(k for k, (real, load) in enumerate(loads) if real <= 1024 < load)
    assert len(ds[fits]["input_ids"]) == loads[fits][0]
    with pytest.raises(ValueError, match=rf"pack {over} holds more than pack_size=1024 tokens after aligning samples "
                                         "to multiples of 16"):
        ds[over]
