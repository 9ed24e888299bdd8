"""Megatron-style metadata: sentinel trimming, padded/unpadded rule, seq_idx."""

import pytest
import torch

from vlm_pack import get_packed_seq_params, pack_batch_sequences
from vlm_pack.core.packed_seq_params import seq_idx_from_cu_seqlens, trim_cu_seqlens


def test_trim_at_argmin():
    cu = torch.tensor([[0, 128, 256, 384, -1, -1]])
    assert trim_cu_seqlens(cu, torch.tensor(4)).tolist() == [0, 128, 256, 384]


def test_trim_at_first_sentinel_without_argmin():
    assert trim_cu_seqlens(torch.tensor([[0, 5, 9, -1, -1]])).tolist() == [0, 5, 9]
    assert trim_cu_seqlens(torch.tensor([0, 5, 9])).tolist() == [0, 5, 9]


def test_seq_idx_from_total_tokens():
    expected = [[0] * 5 + [1] * 2 + [2] * 4 + [3] * 5]
    for cu in ([0, 5, 7, 11], [0, 5, 7, 11, 16]):
        for dtype in (torch.int32, torch.int64):
            seq_idx = seq_idx_from_cu_seqlens(torch.tensor(cu, dtype=dtype), 16)
            assert seq_idx.dtype == torch.int32 and seq_idx.shape == (1, 16)  # Megatron-Core's contract
            assert seq_idx.tolist() == expected


def test_seq_idx_of_get_packed_seq_params_is_int32_1_by_t():
    p = get_packed_seq_params(pack_batch_sequences(torch.tensor([[1, 2, 0], [3, 4, 5]]), pad_to_multiple_of=2))
    assert p.seq_idx.dtype == torch.int32 and p.seq_idx.shape == (1, 6)
    assert p.seq_idx.tolist() == [[0, 0, 1, 1, 1, 1]]


@pytest.mark.parametrize("max_seqlen", [torch.tensor([[8], [6]]), torch.tensor([8, 6]), [8, 6]])
def test_several_max_seqlen_values_are_an_error(max_seqlen):
    batch = {"cu_seqlens": torch.tensor([[0, 8, 14]]), "max_seqlen": max_seqlen}
    with pytest.raises(ValueError, match="max_seqlen has 2 elements.*micro_batch_size=1"):
        get_packed_seq_params(batch)


@pytest.mark.parametrize("max_seqlen", [torch.tensor([[8]]), torch.tensor(8), 8, [[8]]])
def test_one_max_seqlen_value_becomes_an_int(max_seqlen):
    p = get_packed_seq_params({"cu_seqlens": torch.tensor([[0, 8, 14]]), "max_seqlen": max_seqlen})
    assert type(p.max_seqlen_q) is int and p.max_seqlen_q == p.max_seqlen_kv == 8


def test_dict_batch_without_unpadded_leaves_padded_fields_none():
    batch = {"cu_seqlens": torch.tensor([[0, 128, 256, 384, -1, -1]]), "cu_seqlens_argmin": torch.tensor(4),
             "max_seqlen": torch.tensor(128), "tokens": torch.zeros(1, 384, dtype=torch.long)}
    p = get_packed_seq_params(batch)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 128, 256, 384]
    assert p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
    assert p.max_seqlen_q == p.max_seqlen_kv == 128
    assert p.total_tokens == 384 and p.seq_idx.tolist() == [[0] * 128 + [1] * 128 + [2] * 128]


def test_dict_batch_with_unpadded_variant():
    batch = {"cu_seqlens": torch.tensor([[0, 4, 12, -1]]), "cu_seqlens_unpadded": torch.tensor([[0, 3, 8, -1]]),
             "cu_seqlens_unpadded_argmin": torch.tensor(3), "max_seqlen": 8}
    p = get_packed_seq_params(batch)
    assert p.cu_seqlens_q.tolist() == [0, 3, 8]
    assert p.cu_seqlens_q_padded.tolist() == p.cu_seqlens_kv_padded.tolist() == [0, 4, 12]
    assert p.seq_idx is None


def test_from_packed_batch_aligned_and_not():
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    aligned = get_packed_seq_params(pack_batch_sequences(tokens, pad_to_multiple_of=4))
    assert aligned.cu_seqlens_q.tolist() == [0, 3, 8]
    assert aligned.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert aligned.max_seqlen_q == 8 and aligned.total_tokens == 12
    plain = get_packed_seq_params(pack_batch_sequences(tokens))
    assert plain.cu_seqlens_q.tolist() == [0, 3, 8] and plain.cu_seqlens_q_padded is None
    assert plain.seq_idx.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]


def test_in_batch_dict_reads_physical_boundaries_from_cu_seqlens_padded():
    """The collator's dict keeps REAL boundaries in cu_seqlens and physical ones in cu_seqlens_padded."""
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    packed = pack_batch_sequences(tokens, pad_to_multiple_of=4)
    batch = {"input_ids": packed.tokens, "cu_seqlens": packed.cu_seqlens,
             "cu_seqlens_padded": packed.cu_seqlens_padded, **packed.attention_kwargs()}
    p = get_packed_seq_params(batch)
    assert p.cu_seqlens_q.tolist() == [0, 3, 8]
    assert p.cu_seqlens_q_padded.tolist() == p.cu_seqlens_kv_padded.tolist() == [0, 4, 12]
    assert p.max_seqlen_q == 8 and p.total_tokens == 12
    assert p.seq_idx.tolist() == [[0] * 4 + [1] * 8]
    same = get_packed_seq_params(packed)
    assert same.cu_seqlens_q.tolist() == [0, 3, 8] and same.cu_seqlens_q_padded.tolist() == [0, 4, 12]


def test_bare_hugging_face_batch_and_missing_boundaries():
    p = get_packed_seq_params({"input_ids": torch.zeros(1, 9, dtype=torch.long),
                               "cu_seq_lens_q": torch.tensor([0, 4, 9], dtype=torch.int32), "max_length_q": 5})
    assert p.cu_seqlens_q.tolist() == [0, 4, 9] and p.cu_seqlens_q_padded is None
    assert p.max_seqlen_q == 5 and p.seq_idx.tolist() == [[0] * 4 + [1] * 5]
    with pytest.raises(ValueError, match="cannot find the packed sequence boundaries"):
        get_packed_seq_params({"input_ids": torch.zeros(1, 9, dtype=torch.long)})


def megatron_packed_seq_params_class():
    """Megatron-Core's own ``PackedSeqParams``, loaded from its file: ``import megatron.core`` pulls in its
    optimizers and parallel state (~20 s), and that module needs only torch."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (pip install megatron-core)")
    path = next(iter(spec.submodule_search_locations)) + "/core/packed_seq_params.py"
    module_spec = importlib.util.spec_from_file_location("_mcore_packed_seq_params", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.PackedSeqParams


def test_carries_every_megatron_core_field():
    """Megatron-Core reads its fields by name (TEDotProductAttention: ``getattr(p, f) for f in fields(its class)``;
    0.16 reads ``cp_group`` / ``local_cp_size`` first): ours must answer every one, with MCore's meaning."""
    import dataclasses

    mcore = megatron_packed_seq_params_class()
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    ours = get_packed_seq_params(pack_batch_sequences(tokens, pad_to_multiple_of=4))
    names = [f.name for f in dataclasses.fields(mcore)]
    assert {"local_cp_size", "cp_group", "cu_seqlens_q_padded"} <= set(names)
    kept = {name: getattr(ours, name) for name in names}  # what Megatron-Core's TE attention does
    theirs = mcore(**kept)
    assert theirs.qkv_format == "thd" and theirs.cp_group is None and theirs.local_cp_size is None
    assert theirs.cu_seqlens_q.tolist() == [0, 3, 8] and theirs.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert theirs.max_seqlen_q == theirs.max_seqlen_kv == 8
