"""`vlm-pack prepare`: JSONL / datasets dir -> tokenised, packed, written; round trip to the tokenizer's output."""

import json
import pathlib

import numpy as np
import pytest
from transformers import AutoTokenizer

from vlm_pack.cli.main import main
from vlm_pack.offline.dataset import PackedSFTDataset
from vlm_pack.offline.prepare import ALPACA_PROMPT, prepare_packed_sequence_data
from vlm_pack.offline.storage import PACK_INDEX_DTYPE, open_packed, read_metadata
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "sft_sample.jsonl"
TOKENIZER_DIR = qwen_tokenizer_path()
RECORDS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer):
    """The shipped sample at two pack sizes, 10% held out for validation."""
    root = tmp_path_factory.mktemp("prepared")
    written = prepare_packed_sequence_data(
        SAMPLE, tokenizer, root, [4096, 2048], validation_fraction=0.1, seed=3, tokenizer_name="qwen",
        cache_dir=str(root / "cache"), progress=False, log=lambda _: None,
    )
    return root / "packed" / "qwen", written


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _prepare(tokenizer, path, root, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("log", lambda _: None)
    kw.setdefault("cache_dir", str(root / "cache"))
    return prepare_packed_sequence_data(path, tokenizer, root, kw.pop("sizes", [4096]), **kw)


def test_layout_and_metadata(prepared):
    out_dir, written = prepared
    names = sorted(p.name for p in out_dir.iterdir())
    for size in (2048, 4096):
        assert f"{size}_metadata.jsonl" in names
        for split in ("training", "validation"):
            for suffix in ("", ".tokens", ".loss_mask", ".seq_offsets", ".source_index"):
                assert f"{split}_{size}{suffix}.npy" in names
            # no pickle needed, plain dtypes
            index = np.load(out_dir / f"{split}_{size}.npy", allow_pickle=False)
            assert index.dtype == PACK_INDEX_DTYPE
    entries = read_metadata(out_dir / "2048_metadata.jsonl")
    assert [e["split"] for e in entries] == ["training", "validation"]
    train = entries[0]
    assert train["num_samples"] == 180 and entries[1]["num_samples"] == 20
    data = open_packed(out_dir / "training_2048.npy")
    loads = np.add.reduceat(data.sample_lengths(), data.index["sample_start"])
    assert train["num_packs"] == data.num_packs and train["pack_size"] == 2048
    assert train["max_samples_per_bin"] == data.samples_per_pack().max()
    assert train["dataset_max_seqlen"] == data.sample_lengths().max()
    assert train["min_packed_seqlen"] == loads.min() and loads.max() <= 2048
    assert train["packing_factor"] == pytest.approx(180 / data.num_packs, abs=1e-4)
    assert train["packing_efficiency"] == pytest.approx(100 * loads.sum() / (2048 * data.num_packs), abs=1e-4)
    assert train["algorithm"] == "best_fit_decreasing" and train["num_truncated"] == 0
    expected = {(s, n) for s in ("training", "validation") for n in (2048, 4096)}
    assert {(w.split, w.pack_size) for w in written} == expected


def test_every_row_once_and_tokens_round_trip(prepared, tokenizer):
    """JSONL -> packs -> collate -> each sample's tokens equal the tokenizer's output for the rendered text."""
    out_dir, _ = prepared
    seen = []
    for split in ("training", "validation"):
        ds = PackedSFTDataset(out_dir / f"{split}_2048.npy", 2048)
        source = open_packed(out_dir / f"{split}_2048.npy").source_index
        sample = 0
        for i in range(len(ds)):
            batch = ds.collate_fn([ds[i]])
            cu = batch["vlm_pack"]["cu_seqlens"][0].tolist()
            assert cu[0] == 0 and cu[-1] == batch["input_ids"].shape[1]
            for lo, hi in zip(cu[:-1], cu[1:]):
                record = RECORDS[int(source[sample])]
                head = ALPACA_PROMPT.format(prompt=record["prompt"])
                text = head + record["response"] + tokenizer.eos_token
                assert batch["input_ids"][0, lo:hi].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
                labels = batch["labels"][0, lo:hi]
                targets = labels[labels != -100]
                assert tokenizer.decode(targets) == record["response"] + tokenizer.eos_token
                assert batch["vlm_pack"]["loss_mask"][0, lo:hi].sum() == len(targets)
                assert batch["position_ids"][0, lo:hi].tolist() == list(range(hi - lo))
                seen.append(int(source[sample]))
                sample += 1
    assert sorted(seen) == list(range(len(RECORDS)))


def test_truncation_and_dropping_are_counted(tmp_path, tokenizer):
    rows = RECORDS[:40] + [{"prompt": "word " * 400, "response": "ok"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    written = _prepare(tokenizer, path, tmp_path, max_seq_length=256, sizes=[1024], tokenizer_name="t")
    meta = written[0].metadata
    heads = [len(tokenizer(ALPACA_PROMPT.format(prompt=r["prompt"]), add_special_tokens=False)["input_ids"])
             for r in rows]
    totals = [len(tokenizer(ALPACA_PROMPT.format(prompt=r["prompt"]) + r["response"] + tokenizer.eos_token,
                            add_special_tokens=False)["input_ids"]) for r in rows]
    dropped = {i for i, h in enumerate(heads) if h >= 256}  # no response token survives the cut
    assert 40 in dropped and meta["num_dropped"] == len(dropped)
    assert meta["num_truncated"] == sum(t > 256 for i, t in enumerate(totals) if i not in dropped) > 0
    assert meta["num_samples"] == 41 - len(dropped) and meta["dataset_max_seqlen"] == 256
    data = open_packed(written[0].path)
    assert sorted(data.source_index.tolist()) == sorted(set(range(41)) - dropped)


def test_datasets_directory_with_splits(tmp_path, tokenizer):
    import datasets

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list(RECORDS[:30]),
        "validation": datasets.Dataset.from_list(RECORDS[30:37]),
    })
    dd.save_to_disk(str(tmp_path / "ds"))
    written = _prepare(tokenizer, tmp_path / "ds", tmp_path, sizes=[2048], tokenizer_name="t",
                       algorithm="best_fit_shuffle", seed=5)
    assert [(w.split, w.metadata["num_samples"], w.metadata["algorithm"]) for w in written] == [
        ("training", 30, "best_fit_shuffle"), ("validation", 7, "best_fit_shuffle")]


def test_datasets_directory_bad_row_names_the_row(tmp_path, tokenizer):
    import datasets

    rows = [dict(r) for r in RECORDS[:5]]
    rows[3]["response"] = ""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"row 3: empty response"):
        _prepare(tokenizer, tmp_path / "ds", tmp_path, tokenizer_name="t")


def test_separate_validation_file_and_cache_reuse(tmp_path, tokenizer):
    train = _write_jsonl(tmp_path / "train.jsonl", RECORDS[:50])
    val = _write_jsonl(tmp_path / "val.jsonl", RECORDS[50:60])
    first = _prepare(tokenizer, train, tmp_path, validation_path=val, tokenizer_name="t")
    entries = sorted(p for p in (tmp_path / "cache" / "prepare").iterdir() if p.name != "packs")
    assert len(entries) == 2  # one tokenised split per input file
    second = _prepare(tokenizer, train, tmp_path, validation_path=val, tokenizer_name="t", overwrite=True)
    assert sorted(p for p in (tmp_path / "cache" / "prepare").iterdir() if p.name != "packs") == entries
    assert [w.metadata for w in first] == [w.metadata for w in second]
    assert [w.metadata["num_samples"] for w in second] == [50, 10]


def test_parallel_tokenisation_matches_serial(tmp_path, tokenizer, monkeypatch):
    from vlm_pack.offline import encoding

    monkeypatch.setattr(encoding, "MIN_ROWS_PER_PROCESS", 4)  # let 24 rows use the worker pool
    path = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:24])
    serial = _prepare(tokenizer, path, tmp_path / "a", tokenizer_name="t", cache_dir=str(tmp_path / "c1"))
    lines = []
    parallel = _prepare(tokenizer, path, tmp_path / "b", tokenizer_name="t", cache_dir=str(tmp_path / "c2"),
                        num_proc=2, log=lines.append)
    assert any("using 2 worker processes" in line for line in lines)
    a, b = open_packed(serial[0].path), open_packed(parallel[0].path)
    for name in ("tokens", "loss_mask", "seq_offsets", "source_index", "index"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([RECORDS[0], RECORDS[1], '{"prompt": "x", "response": '], r"line 3: malformed JSON"),
        ([RECORDS[0], {"prompt": "x"}], r"line 2: missing field 'response'.*--response-field"),
        ([{"question": "x", "response": "y"}], r"line 1: missing field 'prompt' \(present: question, response\)"),
        ([RECORDS[0], {"prompt": "x", "response": "  "}], r"line 2: empty response"),
        ([{"prompt": 3, "response": "y"}], r"line 1: field 'prompt' must be a string"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, tokenizer, lines, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        _prepare(tokenizer, path, tmp_path, tokenizer_name="t")
    assert not (tmp_path / "packed" / "t" / "training_4096.npy").exists()


def test_sample_longer_than_pack_names_sample_and_fix(tmp_path, tokenizer):
    match = r"training sample \d+ \(input row \d+\) has \d+ tokens, more than the pack size 256.*--max-seq-length"
    with pytest.raises(ValueError, match=match):
        _prepare(tokenizer, SAMPLE, tmp_path, sizes=[256], tokenizer_name="t")


def test_existing_output_needs_overwrite_unless_it_is_up_to_date(tmp_path, tokenizer):
    """A re-run with the same content and settings keeps the output (nothing rewritten, checksums checked); other
    settings, or files edited since, need ``overwrite``."""
    path = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:10])
    first = _prepare(tokenizer, path, tmp_path, tokenizer_name="t", validation_fraction=0.3)
    files = sorted((tmp_path / "packed" / "t").glob("*.npy"))
    stamps = [f.stat().st_mtime_ns for f in files]
    lines = []
    again = _prepare(tokenizer, path, tmp_path, tokenizer_name="t", validation_fraction=0.3, log=lines.append)
    assert [(s.split, s.path, s.metadata) for s in again] == [(s.split, s.path, s.metadata) for s in first]
    assert any("is up to date" in line and "nothing written" in line for line in lines)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    for changed in ({"seed": 1}, {"algorithm": "first_fit_shuffle"}, {"validation_fraction": 0.0}):
        with pytest.raises(FileExistsError, match=r"_4096.*already exists.*--overwrite"):
            _prepare(tokenizer, path, tmp_path, tokenizer_name="t", **{"validation_fraction": 0.3, **changed})
    tokens = tmp_path / "packed" / "t" / "training_4096.tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 1  # same size, one bit flipped
    tokens.write_bytes(bytes(data))
    with pytest.raises(FileExistsError, match=r"already exists"):
        _prepare(tokenizer, path, tmp_path, tokenizer_name="t", validation_fraction=0.3)
    _prepare(tokenizer, path, tmp_path, tokenizer_name="t", validation_fraction=0.3, overwrite=True)
    assert tokens.read_bytes() != bytes(data)


def _reference_file(path):
    """Two packs in the reference pickle format (loss mask shifted left by one, as its writer stores it)."""
    packs = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 0, 1], "seq_start_id": [0, 3]},
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "seq_start_id": [0]},
    ]
    np.save(path, np.array(packs, dtype=object), allow_pickle=True)
    return path


def test_reference_pickle_format_is_opt_in(tmp_path, tokenizer):
    ref = _reference_file(tmp_path / "ref.npy")
    with pytest.raises(ValueError, match="allow-pickle"):
        _prepare(tokenizer, ref, tmp_path, sizes=[8], tokenizer_name="t")
    with pytest.raises(ValueError, match="pickle, which can execute code"):
        PackedSFTDataset(ref, 8)
    direct = PackedSFTDataset(ref, 8, allow_pickle=True)
    assert direct[0]["input_ids"].tolist() == [5, 6, 7, 8, 9]
    # shifted mask [0,1,1 | 0,1] -> aligned [0,0,1 | 0,0]: token t is a target when the mask at t-1 said so
    assert direct[0]["labels"].tolist() == [-100, -100, 7, -100, -100] and direct[1]["labels"].tolist() == [-100, 2, 3]
    # the reader itself (not only the dataset's first-label mask): a sample's first token is never a target, so
    # the shifted mask's last value of sample 1 must not become a target at sample 2's start
    assert open_packed(ref, allow_pickle=True).loss_mask.tolist() == [0, 0, 1, 0, 0, 0, 1, 1]
    written = _prepare(tokenizer, ref, tmp_path, sizes=[8], tokenizer_name="t", allow_pickle=True)
    assert np.asarray(open_packed(written[0].path).loss_mask).tolist() == [0, 0, 1, 0, 0, 0, 1, 1]
    converted = PackedSFTDataset(written[0].path, 8)  # our format: no pickle needed any more
    assert [converted[i]["input_ids"].tolist() for i in range(2)] == [[5, 6, 7, 8, 9], [1, 2, 3]]
    assert converted[0]["position_ids"].tolist() == [0, 1, 2, 0, 1]  # samples of lengths 3 and 2
    assert written[0].metadata["max_samples_per_bin"] == 2 and written[0].metadata["num_packs"] == 2


def test_cli(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:20])
    args = ["prepare", "--input", str(path), "--tokenizer", str(TOKENIZER_DIR), "--output-dir", str(tmp_path),
            "--pack-sizes", "1024", "2048", "--global-batch-size", "32", "--algorithm", "best_fit_decreasing",
            "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pack size 1024 (training): 20 samples" in out and "GBS / n" in out and "efficiency" in out
    assert (tmp_path / "packed" / "tokenizer_files" / "training_2048.npy").exists()
    assert main(args) == 0  # the same content and settings: kept, nothing written
    assert "is up to date" in capsys.readouterr().out
    assert main([*args, "--seed", "1"]) == 2  # other settings: the output exists
    assert "already exists" in capsys.readouterr().err


def test_validation_split_follows_the_seed(tmp_path, tokenizer):
    picked = {}
    for run, seed in enumerate((0, 1, 1)):
        written = prepare_packed_sequence_data(
            SAMPLE, tokenizer, tmp_path / str(run), [4096], validation_fraction=0.3, seed=seed, tokenizer_name="t",
            cache_dir=str(tmp_path / "cache"), progress=False, log=lambda _: None)
        val = next(w for w in written if w.split == "validation")
        picked[run] = sorted(np.asarray(open_packed(val.path).source_index).tolist())
    assert picked[1] == picked[2] and picked[0] != picked[1]


def test_packs_fit_once_samples_are_aligned(tmp_path, tokenizer):
    """With pad_seq_to_mult the packs are made of ALIGNED lengths: every pack still fits once each sample is
    padded to the multiple at collate time (packing raw lengths overflows mid-epoch)."""
    written = _prepare(tokenizer, SAMPLE, tmp_path, sizes=[2048], pad_seq_to_mult=64, tokenizer_name="t")
    arrays = open_packed(written[0].path)
    assert arrays.pack_loads(64).max() <= 2048
    ds = PackedSFTDataset(written[0].path, 2048, pad_seq_to_mult=64)
    assert all(ds.collate_fn([ds[i]])["input_ids"].shape[1] <= 2048 for i in range(len(ds)))


def test_cli_and_api_share_one_options_record(monkeypatch, tmp_path):
    """``vlm-pack prepare`` builds the same :class:`PrepareOptions` the API takes (each flag one field), the API's
    keywords override an options record field by field, and an unknown keyword or a bad value is refused before any
    work."""
    from vlm_pack.offline import prepare as prepare_module
    from vlm_pack.offline.prepare import PrepareOptions

    seen = []
    monkeypatch.setattr(prepare_module, "prepare_packed_sequence_data", lambda *args: seen.append(args) or [])
    assert main(["prepare", "--input", str(SAMPLE), "--tokenizer", str(TOKENIZER_DIR), "--output-dir", str(tmp_path),
                 "--pack-sizes", "512", "1024", "--seed", "7", "--algorithm", "first_fit_shuffle", "--overwrite",
                 "--no-progress", "--validation-fraction", "0.25"]) == 0
    (train, tokenizer, root, sizes, options), = seen
    assert (train, tokenizer, root, sizes) == (str(SAMPLE), str(TOKENIZER_DIR), str(tmp_path), [512, 1024])
    assert options == PrepareOptions(seed=7, algorithm="first_fit_shuffle", overwrite=True, progress=False,
                                     validation_fraction=0.25)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="pack_size"):
        prepare_packed_sequence_data(SAMPLE, TOKENIZER_DIR, tmp_path, [512], pack_size=3)
    with pytest.raises(ValueError, match="unknown packing algorithm 'nope'"):
        prepare_packed_sequence_data(SAMPLE, TOKENIZER_DIR, tmp_path, [512], PrepareOptions(), algorithm="nope")
    assert not any(tmp_path.iterdir())
