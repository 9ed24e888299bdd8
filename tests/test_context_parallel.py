"""Zigzag context-parallel split of packed batches: the DESIGN example, every field, errors, round trips."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack import PackedBatch, pack_batch_sequences, pad_multiple
from vlm_pack.core.packing import segment_ids
from vlm_pack.core.context_parallel import (
    gather_from_context_parallel,
    partition_for_context_parallel,
    unpartition_context_parallel,
    zigzag_indices,
)


def _packed(lengths, cp, *, mrope=False, pad_to_length=None, seed=0):
    """A packed row of random samples, aligned for context parallelism of size ``cp``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.randint(1, 50, (length,), generator=gen)
        mask[row, :length] = 1
    labels = tokens.masked_fill(mask == 0, -100)
    position_ids = None
    if mrope:
        position_ids = torch.randint(0, 30, (3, len(lengths), width), generator=gen)
    return pack_batch_sequences(
        tokens,
        labels,
        loss_mask=mask,
        padding_mask=mask,
        position_ids=position_ids,
        pad_to_multiple_of=pad_multiple(cp, 1, False),
        pad_to_length=pad_to_length,
    )


def test_design_example():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert zigzag_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert zigzag_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_cp4_chunks_pair_early_with_late():
    cu = torch.tensor([0, 16])
    # 8 chunks of 2: rank r keeps chunk r and chunk 7 - r.
    assert zigzag_indices(cu, 4, 0).tolist() == [0, 1, 14, 15]
    assert zigzag_indices(cu, 4, 3).tolist() == [6, 7, 8, 9]


def test_cp1_keeps_everything_and_accepts_odd_lengths():
    cu = torch.tensor([0, 3, 8])
    assert zigzag_indices(cu, 1, 0).tolist() == list(range(8))
    batch = _packed([3, 5], cp=1)
    same = partition_for_context_parallel(batch, 1, 0)
    assert torch.equal(same.tokens, batch.tokens)


def test_zigzag_balances_causal_attention_work():
    """The point of zigzag: every rank gets the same number of causal (query, key) pairs."""
    cu = torch.tensor([0, 16, 48, 56])
    starts = cu[:-1][segment_ids(cu, 56)]
    pairs_per_slot = torch.arange(56) - starts + 1  # keys a query sees inside its own segment
    for cp in (2, 4):
        work = [int(pairs_per_slot[zigzag_indices(cu, cp, r)].sum()) for r in range(cp)]
        assert len(set(work)) == 1, work


def test_partition_packed_batch_splits_every_token_field_and_keeps_metadata():
    batch = _packed([3, 5], cp=2)  # DESIGN: cp=2, lengths 3,5 -> T=12, cu_padded [0,4,12]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 12]
    expected = [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    for rank in range(2):
        part = partition_for_context_parallel(batch, 2, rank)
        assert isinstance(part, PackedBatch)
        index = torch.tensor(expected[rank])
        for name in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"):
            assert torch.equal(getattr(part, name), getattr(batch, name)[..., index]), name
        assert part.tokens.shape == (1, 6)
        assert part.cu_seqlens_padded is batch.cu_seqlens_padded
        assert part.cu_seqlens is batch.cu_seqlens
        assert part.max_seqlen == batch.max_seqlen
        assert torch.equal(part.seq_lengths, batch.seq_lengths)
        assert part.attention_kwargs()["cu_seq_lens_q"].tolist() == [0, 4, 12]


def test_partition_splits_mrope_channels():
    batch = _packed([6, 2, 7], cp=2, mrope=True)
    assert batch.position_ids.shape[:2] == (3, 1)
    index = zigzag_indices(batch.cu_seqlens_padded, 2, 1)
    part = partition_for_context_parallel(batch, 2, 1)
    assert part.position_ids.shape == (3, 1, batch.tokens.shape[1] // 2)
    assert torch.equal(part.position_ids, batch.position_ids[:, :, index])


def test_partition_dict_batch_detects_per_token_keys():
    batch = _packed([5, 9], cp=2)
    total = batch.tokens.shape[1]
    d = batch.to_dict()
    d["mm_token_type_ids"] = torch.arange(total).unsqueeze(0)
    d["seq_idx"] = torch.arange(total)  # 1-D per-token tensor
    d["pixel_values"] = torch.randn(5, total)  # last dim == T by coincidence, but not [.., 1, T]: untouched
    d["image_grid_thw"] = torch.tensor([[1, 2, 2]])
    d["note"] = "kept"
    part = partition_for_context_parallel(d, 2, 0)
    index = zigzag_indices(batch.cu_seqlens_padded, 2, 0)
    assert type(part) is dict and set(part) == set(d)
    assert torch.equal(part["mm_token_type_ids"], index.unsqueeze(0))
    assert torch.equal(part["seq_idx"], index)
    assert torch.equal(part["tokens"], batch.tokens[:, index])
    for key in ("pixel_values", "image_grid_thw", "cu_seqlens", "cu_seqlens_padded", "seq_lengths", "note"):
        assert part[key] is d[key], key
    assert d["tokens"].shape[1] == total  # the input is not modified


@pytest.mark.parametrize(
    "cu_row",
    [[0, 8, 16, -1, -1], [0, 8, 16, 16, 16]],  # -1 sentinels (DESIGN) or the last boundary repeated (pad_cu_seqlens)
)
def test_partition_offline_batch_with_fixed_shape_boundaries(cu_row):
    """Offline collation gives ``cu_seqlens`` as a fixed ``[1, K]`` row, valid up to ``cu_seqlens_argmin``."""
    tokens = torch.arange(16).unsqueeze(0)
    cu = torch.tensor([cu_row], dtype=torch.int32)
    batch = {
        "tokens": tokens,
        "labels": tokens.clone(),
        "position_ids": torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0),
        "cu_seqlens": cu,
        "cu_seqlens_argmin": torch.tensor([[3]]),
        "max_seqlen": torch.tensor([[8]], dtype=torch.int32),
        "cu_seq_lens_q": cu[0],
        "cu_seq_lens_k": cu[0],
        "max_length_q": 8,
    }
    part = partition_for_context_parallel(batch, 2, 1)
    assert part["tokens"].tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    assert part["labels"].tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5, 2, 3, 4, 5]]
    for key in ("cu_seqlens", "cu_seqlens_argmin", "max_seqlen", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q"):
        assert part[key] is batch[key], key


def test_pad_to_length_fill_segment_is_split_too():
    batch = _packed([3, 5], cp=2, pad_to_length=16)
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    shards = [partition_for_context_parallel(batch, 2, r) for r in range(2)]
    assert all(s.tokens.shape == (1, 8) for s in shards)
    assert torch.equal(unpartition_context_parallel(shards).tokens, batch.tokens)


def test_error_names_sequence_length_and_fix():
    with pytest.raises(ValueError, match=r"sequence 1 has padded length 6.*2\*cp = 4.*pad_multiple\(2"):
        zigzag_indices(torch.tensor([0, 8, 14]), 2, 0)
    batch = _packed([3, 5], cp=2)  # aligned to 4, not to 8
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 4, not divisible by 2\*cp = 8"):
        partition_for_context_parallel(batch, 4, 0)


@pytest.mark.parametrize(
    ("cu", "cp", "rank", "message"),
    [
        (torch.tensor([0, 8]), 2, 2, r"cp_rank must be an int in \[0, 2\)"),
        (torch.tensor([0, 8]), 0, 0, "cp_size must be an int >= 1"),
        (torch.tensor([2, 8]), 2, 0, "must start at 0"),
        (torch.tensor([0, 8, 4]), 2, 0, "decreases at sequence 1"),
        (torch.tensor([[0, 4], [0, 4]]), 2, 0, r"must be 1-D"),
    ],
)
def test_bad_boundaries_and_ranks(cu, cp, rank, message):
    with pytest.raises(ValueError, match=message):
        zigzag_indices(cu, cp, rank)


def test_tokens_past_the_boundaries_are_an_error():
    batch = {"tokens": torch.zeros(1, 12, dtype=torch.long), "cu_seqlens_padded": torch.tensor([0, 8])}
    with pytest.raises(ValueError, match="tokens has 12 slots but the boundaries end at 8"):
        partition_for_context_parallel(batch, 2, 0)
    with pytest.raises(ValueError, match="none of"):
        partition_for_context_parallel({"tokens": torch.zeros(1, 8)}, 2, 0)
    with pytest.raises(ValueError, match="PackedBatch .* or a dict"):
        partition_for_context_parallel([torch.zeros(1, 8)], 2, 0)


def test_gather_is_differentiable_and_checks_sizes():
    cu = torch.tensor([0, 8, 16])
    full = torch.randn(16, 3, requires_grad=True)
    shards = [full[zigzag_indices(cu, 2, r)] for r in range(2)]
    back = gather_from_context_parallel(shards, cu, dim=0)
    assert torch.equal(back, full)
    (back * torch.arange(16.0)[:, None]).sum().backward()
    assert torch.equal(full.grad, torch.arange(16.0)[:, None].expand(16, 3))
    with pytest.raises(ValueError, match="shards hold 12 slots"):
        gather_from_context_parallel([torch.zeros(8), torch.zeros(4)], cu)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=23), min_size=1, max_size=6),
    cp=st.sampled_from([1, 2, 4]),
    mrope=st.booleans(),
)
def test_partition_gather_round_trip(lengths, cp, mrope):
    batch = _packed(lengths, cp, mrope=mrope, seed=len(lengths))
    total = batch.tokens.shape[1]
    shards = [partition_for_context_parallel(batch, cp, r) for r in range(cp)]
    # Ranks partition the slots: equal sizes, disjoint, covering the row.
    indices = torch.cat([zigzag_indices(batch.cu_seqlens_padded, cp, r) for r in range(cp)])
    assert torch.equal(indices.sort().values, torch.arange(total))
    assert all(s.tokens.shape[1] == total // cp for s in shards)
    # Each rank keeps the same number of slots of every sequence.
    per_seq = batch.cu_seqlens_padded.diff().long() // cp
    for r in range(cp):
        seg = segment_ids(batch.cu_seqlens_padded, zigzag_indices(batch.cu_seqlens_padded, cp, r))
        assert torch.equal(torch.bincount(seg, minlength=len(lengths)), per_seq)
    restored = unpartition_context_parallel(shards)
    for name in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(restored, name), getattr(batch, name)), name
    assert restored.cu_seqlens_padded is batch.cu_seqlens_padded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_partition_on_cuda_matches_cpu():
    batch = _packed([5, 9, 2], cp=2, mrope=True)
    on_gpu = PackedBatch(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.to_dict().items()})
    for rank in range(2):
        cpu, gpu = partition_for_context_parallel(batch, 2, rank), partition_for_context_parallel(on_gpu, 2, rank)
        assert gpu.tokens.is_cuda and torch.equal(gpu.position_ids.cpu(), cpu.position_ids)
