"""PackedSFTDataset collate contract, CUDA-graph shapes, errors; PackedDataset for the HF Trainer; exact losses."""

import pickle

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from vlm_pack import get_packed_seq_params
from vlm_pack.core.batch import model_inputs
from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION, enable_packing
from vlm_pack.core.loss import loss_sum_and_count, shift_packed_labels
from vlm_pack.offline import storage
from vlm_pack.offline.algorithms import packing_stats
from vlm_pack.offline.dataset import PackedDataset, PackedSFTDataset
from vlm_pack.offline.storage import PackedArrays, build_index, sibling_paths, write_packed

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, max_abs

PAD = 0
# pack 0: A = 11 12 13 (loss on 12 13), B = 21..25 (loss on 23 24 25); pack 1: C = 31 32 (loss on 32)
KNOWN = [[([11, 12, 13], [0, 1, 1]), ([21, 22, 23, 24, 25], [0, 0, 1, 1, 1])], [([31, 32], [0, 1])]]


def _write(path, packs):
    """Write ``packs`` (lists of (tokens, loss_mask) samples) in our on-disk format."""
    samples = [s for pack in packs for s in pack]
    lengths = np.array([len(t) for t, _ in samples])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    arrays = PackedArrays(
        index=build_index(np.array([len(p) for p in packs]), offsets),
        tokens=np.concatenate([t for t, _ in samples]),
        loss_mask=np.concatenate([m for _, m in samples]),
        seq_offsets=offsets,
        source_index=np.arange(len(samples)),
    )
    return write_packed(path, arrays)


@pytest.fixture
def known(tmp_path):
    return _write(tmp_path / "training_12.npy", KNOWN)


def test_collate_known_pack_no_padding(known):
    ds = PackedSFTDataset(known, 12)
    assert len(ds) == 2 and ds.max_samples_per_bin == 2
    b = ds.collate_fn([ds[0]])
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 23, 24, 25]]
    assert b["labels"].tolist() == [[-100, 12, 13, -100, -100, 23, 24, 25]]  # aligned, -100 off-response
    assert b["vlm_pack"]["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    meta = b["vlm_pack"]
    assert meta["cu_seqlens"].tolist() == [[0, 3, 8]] and meta["cu_seqlens"].dtype == torch.int32
    assert meta["cu_seqlens_argmin"].tolist() == [[3]] and meta["max_seqlen"].tolist() == [[5]]
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 8] and b["cu_seq_lens_k"] is b["cu_seq_lens_q"]
    assert b["max_length_q"] == b["max_length_k"] == 5
    assert "cu_seqlens_unpadded" not in b["vlm_pack"] and "attention_mask" not in b


def test_first_token_of_a_sample_is_never_a_target(tmp_path):
    path = _write(tmp_path / "training_8.npy", [[([1, 2], [1, 1]), ([3, 4, 5], [1, 1, 1])]])
    ds = PackedSFTDataset(path, 8)
    assert ds[0]["labels"].tolist() == [-100, 2, -100, 4, 5]  # the item itself, before any collate
    b = ds.collate_fn([ds[0]])
    assert b["labels"].tolist() == [[-100, 2, -100, 4, 5]]
    assert b["vlm_pack"]["loss_mask"].tolist() == [[0, 1, 0, 1, 1]]


def test_collate_aligned_and_padded_to_pack_size(known):
    ds = PackedSFTDataset(known, 12, pad_to_max_length=True, pad_seq_to_mult=2, pad_token_id=PAD)
    b = ds.collate_fn([ds[0]])
    # lengths 3, 5 aligned to 4, 6; the 2 fill slots form one trailing segment
    assert b["input_ids"].tolist() == [[11, 12, 13, PAD, 21, 22, 23, 24, 25, PAD, PAD, PAD]]
    assert b["labels"].tolist() == [[-100, 12, 13, -100, -100, -100, 23, 24, 25, -100, -100, -100]]
    assert b["vlm_pack"]["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]]
    meta = b["vlm_pack"]
    assert meta["cu_seqlens"].tolist() == [[0, 4, 10, 12]] and meta["cu_seqlens_argmin"].tolist() == [[4]]
    assert meta["cu_seqlens_unpadded"].tolist() == [[0, 3, 8, 8]] and meta["cu_seqlens_unpadded_argmin"].tolist() == [[4]]
    assert meta["max_seqlen"].tolist() == [[6]] and b["max_length_q"] == 6


def test_pad_cu_seqlens_gives_every_batch_the_same_shapes(known):
    ds = PackedSFTDataset(known, 12, metadata={"pack_size": 12, "max_samples_per_bin": 3}, pad_to_max_length=True,
                          pad_cu_seqlens=True, pad_seq_to_mult=2)
    batches = [ds.collate_fn([ds[i]]) for i in range(len(ds))]
    # max_samples_per_bin + 2 entries, the last boundary repeated
    assert batches[0]["vlm_pack"]["cu_seqlens"].tolist() == [[0, 4, 10, 12, 12]]
    assert batches[1]["vlm_pack"]["cu_seqlens"].tolist() == [[0, 2, 12, 12, 12]]
    assert batches[1]["vlm_pack"]["cu_seqlens_unpadded"].tolist() == [[0, 2, 2, 2, 2]]
    assert [b["vlm_pack"]["cu_seqlens_argmin"].item() for b in batches] == [4, 3]
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
        assert batches[0][key].shape == batches[1][key].shape, key
    for key in ("loss_mask", "cu_seqlens", "cu_seqlens_unpadded", "max_seqlen"):
        assert batches[0]["vlm_pack"][key].shape == batches[1]["vlm_pack"][key].shape, key
    assert all(b["vlm_pack"]["max_seqlen"].item() == 12 and b["max_length_q"] == 12 for b in batches)
    # the Megatron view trims the padding back off
    params = get_packed_seq_params(batches[0])
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 8] and params.cu_seqlens_q_padded.tolist() == [0, 4, 10, 12]
    assert params.max_seqlen_q == 12 and params.total_tokens == 12


def test_metadata_file_and_largest_split_wins(known, tmp_path):
    meta = tmp_path / "12_metadata.jsonl"
    meta.write_text('{"split": "training", "pack_size": 12, "max_samples_per_bin": 2}\n'
                    '{"split": "validation", "pack_size": 12, "max_samples_per_bin": 5}\n')
    ds = PackedSFTDataset(known, 12, metadata=meta, pad_to_max_length=True, pad_cu_seqlens=True)
    assert ds.collate_fn([ds[1]])["vlm_pack"]["cu_seqlens"].shape == (1, 7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pad_cu_seqlens": True, "metadata": {"pack_size": 12, "max_samples_per_bin": 2}},
         "pad_cu_seqlens=True needs pad_to_max_length=True"),
        ({"pad_cu_seqlens": True, "pad_to_max_length": True}, "needs the pack metadata"),
        ({"metadata": {"pack_size": 4096, "max_samples_per_bin": 2}}, "no entry with pack_size=12"),
        ({"metadata": {"pack_size": 12, "max_samples_per_bin": 1}}, "belongs to other data"),
        ({"pad_to_max_length": True, "pad_seq_to_mult": 5}, "must be a multiple of pad_seq_to_mult=5"),
    ],
)
def test_bad_options(known, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedSFTDataset(known, 12, **kwargs)


def test_pack_longer_than_pack_size(known):
    with pytest.raises(ValueError, match=r"pack 0 holds 8 tokens, more than pack_size=6"):
        PackedSFTDataset(known, 6)
    with pytest.raises(ValueError, match=r"pack 0 holds 12 tokens after aligning samples to multiples of 4.*"
                                         r"--pad-seq-to-mult 4"):
        PackedSFTDataset(known, 8, pad_seq_to_mult=4)


def test_micro_batch_must_be_one(known):
    ds = PackedSFTDataset(known, 12)
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        ds.collate_fn([ds[0], ds[1]])
    loader = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=ds.collate_fn)
    assert [b["input_ids"].shape[1] for b in loader] == [8, 2]


def test_broken_files_are_reported(known):
    sibling_paths(known)["loss_mask"].unlink()
    with pytest.raises(FileNotFoundError, match="companion file"):
        PackedSFTDataset(known, 12)


def test_inconsistent_files_are_reported(known):
    np.save(sibling_paths(known)["tokens"], np.zeros(5, dtype=np.int32))
    with pytest.raises(ValueError, match="inconsistent packed data"):
        PackedSFTDataset(known, 12)


def test_pickles_without_copying_arrays(known):
    ds = PackedSFTDataset(known, 12, pad_seq_to_mult=2)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    again = pickle.loads(blob)
    assert again[0]["input_ids"].tolist() == ds[0]["input_ids"].tolist()


# ---- exactness on a tiny Llama -------------------------------------------------------------------------------

VOCAB = 97


def _llama_pair():
    """Packed model (our varlen attention) and reference model (stock sdpa), same weights, own config objects."""
    def build():
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)

    packed, reference = build(), build()
    reference.load_state_dict(packed.state_dict())
    enable_packing(packed)
    reference.set_attn_implementation("sdpa")
    assert packed.config._attn_implementation == ATTN_IMPLEMENTATION
    return packed, reference


def _random_packs(seed=0):
    rng = np.random.default_rng(seed)
    packs = []
    for lengths in ([5, 17, 9], [30, 2, 12, 7], [21]):
        pack = []
        for n in lengths:
            tokens = rng.integers(1, VOCAB, n)
            mask = (np.arange(n) >= rng.integers(1, n + 1)).astype(np.uint8)  # prompt, then response
            pack.append((tokens, mask))
        packs.append(pack)
    return packs


def _reference_loss(model, samples):
    """Unpacked recipe: every sample alone, next-token CE over its response tokens; (sum, count)."""
    total, count = 0.0, 0
    for tokens, mask in samples:
        ids = torch.as_tensor(tokens, dtype=torch.long)[None]
        labels = torch.where(torch.as_tensor(mask, dtype=torch.bool), ids[0], -100)
        logits = model(input_ids=ids, use_cache=False).logits[0]
        keep = labels[1:] != -100
        ce = torch.nn.functional.cross_entropy(logits[:-1][keep], labels[1:][keep], reduction="sum")
        total, count = total + ce, count + int(keep.sum())
    return total, count


def test_packed_loss_and_grads_equal_unpacked_on_tiny_llama(tmp_path):
    packs = _random_packs()
    path = _write(tmp_path / "training_64.npy", packs)
    ds = PackedSFTDataset(path, 64, metadata={"pack_size": 64, "max_samples_per_bin": 4}, pad_to_max_length=True,
                          pad_cu_seqlens=True, pad_seq_to_mult=4)
    packed_model, reference = _llama_pair()
    reference64 = fp64_copy(reference)
    floor = NoiseFloor("logits")

    total, count = 0.0, 0
    for i in range(len(ds)):
        b = ds.collate_fn([ds[i]])
        logits = packed_model(**model_inputs(b), use_cache=False).logits
        loss_sum, n = loss_sum_and_count(logits, shift_packed_labels(b["labels"], b["cu_seq_lens_q"]))
        total, count = total + loss_sum, count + int(n)
        # per-sample logits equal the unpacked model's logits
        real = b["vlm_pack"]["cu_seqlens_unpadded"][0].tolist()
        phys = b["vlm_pack"]["cu_seqlens"][0].tolist()
        for s, (tokens, _) in enumerate(packs[i]):
            ids = torch.as_tensor(tokens, dtype=torch.long)[None]
            ref_logits = reference(input_ids=ids, use_cache=False).logits
            with torch.no_grad():
                floor.observe(ref_logits, reference64(input_ids=ids, use_cache=False).logits)
            got = logits[0, phys[s] : phys[s] + (real[s + 1] - real[s])]
            floor.check(max_abs(got, ref_logits[0]), f"pack {i}, sample {s}")
    samples = [s for p in packs for s in p]
    ref_total, ref_count = _reference_loss(reference, samples)
    assert count == ref_count > 0
    packed_loss, ref_loss = total / count, ref_total / ref_count
    loss_floor = NoiseFloor("loss")
    with torch.no_grad():
        exact_total, _ = _reference_loss(reference64, samples)
    loss_floor.observe(ref_loss, exact_total / ref_count)
    loss_floor.check(max_abs(packed_loss, ref_loss))
    packed_loss.backward()
    ref_loss.backward()
    assert_grads_close({n: p.grad for n, p in packed_model.named_parameters()},
                       {n: q.grad for n, q in reference.named_parameters()})


# ---- PackedDataset (Hugging Face Trainer) ---------------------------------------------------------------------

def _tokenized(n=40, seed=1, labels=False):
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [rng.integers(1, VOCAB, int(k)).tolist() for k in rng.integers(2, 30, n)]}
    if labels:
        rows["labels"] = [[t if j % 3 else -100 for j, t in enumerate(ids)] for ids in rows["input_ids"]]
    return Dataset.from_dict(rows)


def _item_cu(item) -> list[int]:
    """Sample boundaries of a pack item: where its position ids restart at 0, plus the end."""
    positions = torch.as_tensor(item["position_ids"])
    return (positions == 0).nonzero().flatten().tolist() + [positions.numel()]


@pytest.mark.parametrize("with_labels", [False, True])
def test_packed_dataset_items(with_labels):
    data = _tokenized(labels=with_labels).shuffle(seed=3)  # an index-mapped view must be read in its own order
    ds = PackedDataset(data, tokenizer=None, pack_len=64, algorithm="best_fit_shuffle", seed=2)
    seen = []
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == {"input_ids", "labels", "position_ids"}  # forward arguments: Trainer keeps them
        cu = _item_cu(item)
        assert cu[0] == 0 and cu[-1] == item["input_ids"].numel() <= 64
        for lo, hi in zip(cu[:-1], cu[1:]):
            ids = item["input_ids"][lo:hi].tolist()
            row = int(ds.order[len(seen)])
            assert ids == data[row]["input_ids"]
            expected = data[row]["labels"] if with_labels else ids
            assert item["labels"][lo:hi].tolist() == [-100] + expected[1:]  # never a target across a boundary
            assert item["position_ids"][lo:hi].tolist() == list(range(hi - lo))
            seen.append(row)
    assert sorted(seen) == list(range(len(data)))


def test_packed_dataset_collate_and_stat(capsys):
    data = _tokenized()
    ds = PackedDataset(data, None, 64)
    b = ds.collate([ds[0], ds[1]])
    n0 = ds[0]["input_ids"].numel()
    expected_cu = _item_cu(ds[0]) + [c + n0 for c in _item_cu(ds[1])[1:]]
    assert b["cu_seq_lens_q"].tolist() == expected_cu and b["input_ids"].shape == (1, expected_cu[-1])
    assert b["max_length_q"] == max(np.diff(expected_cu))
    assert torch.equal(b["labels"][0, :n0], ds[0]["labels"]) and torch.equal(b["position_ids"][0, n0:],
                                                                               ds[1]["position_ids"])
    report = ds.stat()
    out = capsys.readouterr().out
    assert "before 40 samples" in out and f"after {len(ds)} packs" in out
    stats = packing_stats(ds.lengths, ds.bin_ids, 64)
    assert report["packs"] == len(ds) == stats.num_packs and report["efficiency"] == stats.packing_efficiency
    assert report["padded_efficiency"] == pytest.approx(100 * ds.lengths.sum() / (40 * ds.lengths.max()))


def test_packed_dataset_pads_the_row_with_the_tokenizer_pad_id():
    class Tok:
        pad_token_id = 96

    ds = PackedDataset(_tokenized(), Tok(), 64, pad_to_multiple_of=16)
    item = next(ds[i] for i in range(len(ds)) if ds[i]["input_ids"].numel() % 16)
    b = ds.collate([item])
    real, width = item["input_ids"].numel(), b["input_ids"].shape[1]
    assert width % 16 == 0 and 0 < width - real < 16
    assert b["cu_seq_lens_q"].tolist() == _item_cu(item) + [width]
    assert (b["input_ids"][0, real:] == 96).all() and (b["labels"][0, real:] == -100).all()
    assert b["position_ids"][0, real:].tolist() == list(range(width - real))


def test_packed_dataset_errors():
    with pytest.raises(ValueError, match=r"sample \d+ has \d+ tokens, more than the pack size 16"):
        PackedDataset(_tokenized(), None, 16)
    bad = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[1, 2, 3], [4]]})
    with pytest.raises(ValueError, match="sample 1: labels and input_ids have different lengths"):
        PackedDataset(bad, None, 16)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        PackedDataset(Dataset.from_dict({"text": ["a"]}), None, 16)


def test_packed_dataset_hf_loss_equals_unpacked():
    """The model's own (HF) loss on a collated batch of packs equals the unpacked mean token loss."""
    data = _tokenized(n=12, seed=4)  # labels = input_ids: only the boundary masking keeps samples apart
    ds = PackedDataset(data, None, 48)
    packed_model, reference = _llama_pair()
    batch = ds.collate([ds[i] for i in range(len(ds))])
    loss = packed_model(**batch, use_cache=False).loss
    samples = [(np.asarray(r["input_ids"]), np.ones(len(r["input_ids"]), dtype=bool)) for r in data]
    with torch.no_grad():
        ref_total, ref_count = _reference_loss(reference, samples)
        exact_total, _ = _reference_loss(fp64_copy(reference), samples)
    floor = NoiseFloor("loss")
    floor.observe(ref_total / ref_count, exact_total / ref_count)
    floor.check(max_abs(loss, ref_total / ref_count))


@pytest.mark.parametrize("compiled_from", [0, 1 << 40])  # the compiled loop / the vectorised index
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64])
def test_gather_segments_equals_plain_concatenation(compiled_from, dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "GATHER_COMPILED_FROM", compiled_from)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=40)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    flat = rng.integers(0, 120, size=offsets[-1]).astype(dtype)
    np.save(tmp_path / "flat.npy", flat)
    rows = rng.permutation(40)[:30]
    want = np.concatenate([flat[offsets[r]:offsets[r + 1]] for r in rows])
    for source in (flat, np.load(tmp_path / "flat.npy", mmap_mode="r")):  # the cache hands out read-only maps
        got, new_offsets = storage.gather_segments(source, offsets, rows)
        assert got.dtype == dtype and np.array_equal(got, want)
        assert np.array_equal(np.diff(new_offsets), lengths[rows])
    with pytest.raises(IndexError, match=r"segment rows must be in \[0, 40\)"):
        storage.gather_segments(flat, offsets, np.array([3, -1]))
