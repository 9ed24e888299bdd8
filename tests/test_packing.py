"""Core in-batch packing: known cases, padding conventions, errors, and an unpack round-trip property."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack import pack_batch_sequences, pad_multiple


def right_padded(lengths, pad=0, width=None, start=1):
    """Rows of consecutive ids (never equal to pad) right-padded to ``width``."""
    width = width or max(lengths)
    rows, nxt = [], start
    for n in lengths:
        rows.append(list(range(nxt, nxt + n)) + [pad] * (width - n))
        nxt += n
    return torch.tensor(rows)


# --- known cases (DESIGN.md) -------------------------------------------------------------------------------


def test_lengths_3_4_no_alignment():
    b = pack_batch_sequences(right_padded([3, 4]))
    assert b.tokens.shape == (1, 7)
    assert b.cu_seqlens.tolist() == [0, 3, 7]
    assert b.cu_seqlens_padded.tolist() == [0, 3, 7]
    assert b.max_seqlen == 4
    assert b.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert not b.padding_mask.any()


def test_lengths_3_5_multiple_2():
    b = pack_batch_sequences(right_padded([3, 5]), pad_to_multiple_of=2)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 10]
    assert b.cu_seqlens.tolist() == [0, 3, 8]
    assert b.max_seqlen == 6


def test_lengths_2_3_multiple_4():
    b = pack_batch_sequences(right_padded([2, 3]), pad_to_multiple_of=4)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 8]


def test_positions_restart_per_sequence():
    b = pack_batch_sequences(right_padded([2, 3]))
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2]]


def test_positions_continue_into_alignment_slots():
    b = pack_batch_sequences(right_padded([3]), pad_to_multiple_of=4)
    assert b.position_ids.tolist() == [[0, 1, 2, 3]]


def test_context_parallel_2_lengths_3_5():
    m = pad_multiple(context_parallel_size=2)
    assert m == 4
    b = pack_batch_sequences(right_padded([3, 5]), pad_to_multiple_of=m)
    assert b.tokens.shape[1] == 12
    assert b.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert b.max_seqlen == 8


@pytest.mark.parametrize(
    "cp,tp,sp,expected",
    [(1, 1, False, 1), (2, 1, False, 4), (4, 1, False, 8), (1, 4, True, 4), (1, 4, False, 1), (2, 4, True, 8),
     (3, 2, True, 6), (2, 3, True, 12)],
)
def test_pad_multiple(cp, tp, sp, expected):
    assert pad_multiple(cp, tp, sp) == expected


def test_pad_multiple_rejects_zero():
    with pytest.raises(ValueError, match="context_parallel_size"):
        pad_multiple(0, 1, False)


# --- fill values and conventions ---------------------------------------------------------------------------


def test_fill_values_in_alignment_slots():
    tokens = right_padded([3, 1], pad=7, start=10)
    labels = tokens.clone()
    loss_mask = torch.ones_like(tokens)
    b = pack_batch_sequences(tokens, labels, loss_mask, pad_token_id=7, pad_to_multiple_of=4)
    assert b.tokens.tolist() == [[10, 11, 12, 7, 13, 7, 7, 7]]
    assert b.labels.tolist() == [[10, 11, 12, -100, 13, -100, -100, -100]]
    assert b.loss_mask.tolist() == [[1, 1, 1, 0, 1, 0, 0, 0]]
    assert b.padding_mask.tolist() == [[False, False, False, True, False, True, True, True]]
    assert b.seq_lengths.tolist() == [3, 1]


def test_left_padded_rows_via_mask():
    tokens = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    b = pack_batch_sequences(tokens, padding_mask=mask)
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9]]
    assert b.cu_seqlens.tolist() == [0, 3, 8]
    # attention_mask (HF's 2-D padding mask) works the same way
    b2 = pack_batch_sequences(tokens, attention_mask=mask)
    assert torch.equal(b.tokens, b2.tokens)


def test_left_padded_given_positions_are_gathered():
    tokens = torch.tensor([[0, 5, 6], [1, 2, 3]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions = torch.tensor([[0, 0, 1], [0, 1, 2]])
    b = pack_batch_sequences(tokens, padding_mask=mask, position_ids=positions, pad_to_multiple_of=2)
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]


def test_left_padding_without_mask_is_an_error():
    tokens = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
    with pytest.raises(ValueError, match="row 0 .*left-padded.*padding_mask"):
        pack_batch_sequences(tokens)


def test_non_contiguous_mask_rejected():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]])
    with pytest.raises(ValueError, match="row 1 is not one contiguous run"):
        pack_batch_sequences(tokens, padding_mask=mask)


@pytest.mark.parametrize(
    "row",
    [[0, 1, 1, 0, 1], [1, 0, 1, 1, 1], [0, 1, 1, 1, 0]],  # hole in a left-/right-padded row; padding on both sides
)
def test_other_mask_shapes_rejected(row):
    tokens = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1], row])
    with pytest.raises(ValueError, match="row 1 is not one contiguous run"):
        pack_batch_sequences(tokens, padding_mask=mask)


def test_bool_mask_accepted():
    tokens = torch.tensor([[0, 5, 6], [1, 2, 0]])
    b = pack_batch_sequences(tokens, padding_mask=torch.tensor([[False, True, True], [True, True, False]]))
    assert b.tokens.tolist() == [[5, 6, 1, 2]]


def test_nonzero_pad_id():
    pad = 151643
    tokens = torch.tensor([[0, 4, pad, pad], [3, 0, 2, pad]])  # 0 is a real token here
    b = pack_batch_sequences(tokens, pad_token_id=pad, pad_to_multiple_of=2)
    assert b.tokens.tolist() == [[0, 4, 3, 0, 2, pad]]
    assert b.cu_seqlens.tolist() == [0, 2, 5]
    assert b.cu_seqlens_padded.tolist() == [0, 2, 6]


def test_rows_full_to_the_brim():
    tokens = torch.arange(1, 13).view(3, 4)
    b = pack_batch_sequences(tokens)
    assert b.tokens.tolist() == [list(range(1, 13))]
    assert b.cu_seqlens.tolist() == [0, 4, 8, 12]


def test_empty_rows_dropped_and_order_kept():
    tokens = torch.tensor([[0, 0, 0], [4, 5, 0], [0, 0, 0], [6, 0, 0]])
    b = pack_batch_sequences(tokens)
    assert b.tokens.tolist() == [[4, 5, 6]]
    assert b.cu_seqlens.tolist() == [0, 2, 3]
    assert b.num_sequences == 2


def test_all_rows_empty_is_a_clear_error():
    with pytest.raises(ValueError, match="all 2 rows are empty"):
        pack_batch_sequences(torch.zeros(2, 5, dtype=torch.long))


def test_mrope_three_channel_positions():
    tokens = right_padded([2, 3], width=4)
    positions = torch.stack([torch.arange(4).expand(2, 4) + 10 * c for c in range(3)])  # [3, 2, 4]
    b = pack_batch_sequences(tokens, position_ids=positions, pad_to_multiple_of=4)
    assert b.position_ids.shape == (3, 1, 8)
    for c in range(3):
        base = 10 * c
        assert b.position_ids[c, 0].tolist() == [base, base + 1, base + 2, base + 3, base, base + 1, base + 2, base + 3]


def test_dtype_and_device_preserved():
    tokens = right_padded([2, 3]).to(torch.int32)
    labels = tokens.to(torch.int64)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    positions = torch.arange(3).expand(2, 3).to(torch.int16)
    b = pack_batch_sequences(tokens, labels, loss_mask, position_ids=positions, pad_to_multiple_of=2)
    assert b.tokens.dtype == torch.int32
    assert b.labels.dtype == torch.int64
    assert b.loss_mask.dtype == torch.float32
    assert b.position_ids.dtype == torch.int16
    assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
    assert b.padding_mask.dtype == torch.bool
    assert {t.device for t in (b.tokens, b.cu_seqlens, b.position_ids)} == {tokens.device}


def test_pad_to_length_adds_trailing_fill_segment():
    b = pack_batch_sequences(right_padded([3, 2]), torch.ones(2, 3, dtype=torch.long), pad_to_multiple_of=2,
                             pad_to_length=10)
    assert b.tokens.shape == (1, 10)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 6, 10]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 5]
    assert b.padding_mask[0, 6:].all() and b.padding_mask[0].sum() == 5
    assert b.labels[0, 6:].eq(-100).all()
    assert b.position_ids[0, 6:].tolist() == [0, 1, 2, 3]
    assert b.num_sequences == 2


def test_pad_to_length_too_small():
    with pytest.raises(ValueError, match="pad_to_length=7 is smaller than the packed width 10"):
        pack_batch_sequences(right_padded([3, 5]), pad_to_multiple_of=2, pad_to_length=7)


def test_shape_mismatch_named():
    with pytest.raises(ValueError, match="labels has shape"):
        pack_batch_sequences(right_padded([2, 3]), labels=torch.zeros(2, 5, dtype=torch.long))


def test_attention_kwargs_use_physical_boundaries():
    b = pack_batch_sequences(right_padded([3, 5]), pad_to_multiple_of=2)
    kw = b.attention_kwargs()
    assert kw["cu_seq_lens_q"].tolist() == [0, 4, 10] and kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 6


# --- property: unpacking by cu_seqlens returns every real row exactly, in order ------------------------------


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 8))
    width = draw(st.integers(1, 24))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    left = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    m = draw(st.sampled_from([1, 2, 3, 4, 8]))
    channels = draw(st.sampled_from([0, 3]))
    return lengths, left, width, m, channels


@settings(max_examples=150, deadline=None)
@given(padded_batches())
def test_unpack_round_trip(case):
    lengths, left, width, m, channels = case
    rng = np.random.default_rng(sum(lengths) + width)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    originals = []
    for i, (n, is_left) in enumerate(zip(lengths, left)):
        real = torch.from_numpy(rng.integers(1, 1000, size=n))
        sl = slice(width - n, width) if is_left else slice(0, n)
        tokens[i, sl], mask[i, sl] = real, 1
        originals.append(real)
    labels = tokens * 2
    positions = None
    if channels:
        positions = torch.arange(width).repeat(channels, len(lengths), 1) * (1 + torch.arange(channels)).view(-1, 1, 1)

    if sum(lengths) == 0:
        with pytest.raises(ValueError, match="empty"):
            pack_batch_sequences(tokens, labels, padding_mask=mask, pad_to_multiple_of=m)
        return
    b = pack_batch_sequences(tokens, labels, padding_mask=mask, position_ids=positions, pad_to_multiple_of=m)

    total = b.tokens.shape[1]
    assert int(b.cu_seqlens_padded[-1]) == total
    padded_lengths = b.cu_seqlens_padded.diff()
    assert (padded_lengths % m == 0).all()
    assert b.max_seqlen == int(padded_lengths.max())
    kept = [o for o in originals if len(o)]
    assert b.seq_lengths.tolist() == [len(o) for o in kept]
    assert int(b.padding_mask.sum()) == total - sum(lengths)
    for i, original in enumerate(kept):
        start = int(b.cu_seqlens_padded[i])
        n = int(b.seq_lengths[i])
        assert int(b.cu_seqlens[i + 1] - b.cu_seqlens[i]) == n
        assert torch.equal(b.tokens[0, start:start + n], original)
        assert torch.equal(b.labels[0, start:start + n], original * 2)
        end = int(b.cu_seqlens_padded[i + 1])
        assert b.labels[0, start + n:end].eq(-100).all()
        if channels:
            row_idx = [j for j, ln in enumerate(lengths) if ln][i]
            offset = width - n if left[row_idx] else 0
            for c in range(channels):
                real_pos = [(offset + k) * (c + 1) for k in range(n)]
                fill_pos = [real_pos[-1] + k for k in range(1, end - start - n + 1)]
                assert b.position_ids[c, 0, start:end].tolist() == real_pos + fill_pos
        else:
            assert b.position_ids[0, start:end].tolist() == list(range(end - start))


def test_rows_longer_than_the_fused_reduction_range():
    """Past ~92k tokens per row lengths and column sums take two reductions; same results, same checks."""
    width = 100_000
    tokens = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    mask[0, :95_000] = 1  # right padded
    mask[1, 7:] = 1  # left padded
    tokens[mask.bool()] = 5
    b = pack_batch_sequences(tokens, padding_mask=mask)
    assert b.cu_seqlens.tolist() == [0, 95_000, 95_000 + width - 7]
    mask[1, 50_000] = 0
    with pytest.raises(ValueError, match="row 1 is not one contiguous run"):
        pack_batch_sequences(tokens, padding_mask=mask)
