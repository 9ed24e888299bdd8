"""Core in-batch packing: known cases, padding conventions, errors, and an unpack round-trip property."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack import pack_batch_sequences, pack_sequences, pad_multiple
from vlm_pack.core import packing


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
    with pytest.raises(ValueError, match="pad_to_length=8 is smaller than the packed width 10"):
        pack_batch_sequences(right_padded([3, 5]), pad_to_multiple_of=2, pad_to_length=8)


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


# --- input checks (issue 12.8): each case used to pass silently or raise a raw error -------------------------


def test_fractional_mask_is_an_error_not_a_dropped_row():
    mask = torch.tensor([[0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"padding_mask / attention_mask must be bool or integer 0/1; got dtype torch\.float32"):
        pack_batch_sequences(right_padded([3, 2], width=4), padding_mask=mask)


@pytest.mark.parametrize("bad", [-1, 2])
def test_mask_values_other_than_0_1_are_an_error(bad):
    mask = torch.tensor([[bad, 1, 1, 0], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match=f"must hold only 0 and 1; found {bad}"):
        pack_batch_sequences(right_padded([3, 2], width=4), padding_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_float_or_bool_token_ids_are_an_error(dtype):
    with pytest.raises(ValueError, match=rf"tokens must be an integer tensor \(ids\); got dtype {dtype}"):
        pack_batch_sequences(right_padded([3, 2]).to(dtype))
    with pytest.raises(ValueError, match=r"labels must be an integer tensor"):
        pack_batch_sequences(right_padded([3, 2]), labels=right_padded([3, 2]).to(dtype))
    with pytest.raises(ValueError, match=r"tokens\[1\] must be an integer tensor"):
        pack_sequences([torch.tensor([1, 2]), torch.tensor([3]).to(dtype)])


def test_pad_to_length_must_keep_the_fill_segment_aligned():
    with pytest.raises(ValueError, match=r"pad_to_length=11 is not a multiple of pad_to_multiple_of=4.*pad_to_length=12"):
        pack_batch_sequences(right_padded([3, 2]), pad_to_multiple_of=4, pad_to_length=11)
    b = pack_batch_sequences(right_padded([3, 2]), pad_to_multiple_of=4, pad_to_length=12)
    assert (b.cu_seqlens_padded.diff() % 4 == 0).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [({"pad_to_multiple_of": 2.0}, "pad_to_multiple_of must be an int; got 2.0"),
     ({"pad_to_multiple_of": True}, "pad_to_multiple_of must be an int; got True"),
     ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be >= 1; got 0"),
     ({"pad_to_length": 12.0}, "pad_to_length must be an int; got 12.0"),
     ({"pad_token_id": 0.5}, "pad_token_id must be an int; got 0.5")],
)
def test_non_integer_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_batch_sequences(right_padded([3, 2]), **kwargs)
    with pytest.raises(ValueError, match=message):
        pack_sequences([torch.tensor([1, 2])], **kwargs)


def test_numpy_integer_arguments_accepted():
    b = pack_batch_sequences(right_padded([3, 2]), pad_to_multiple_of=np.int64(2), pad_to_length=np.int32(8))
    assert b.tokens.shape == (1, 8)


@pytest.mark.parametrize("shape", [(2, 0), (0, 4)])
def test_zero_width_or_no_rows_is_a_clear_error(shape):
    with pytest.raises(ValueError, match=r"tokens has shape .*: no slot to pack"):
        pack_batch_sequences(torch.zeros(shape, dtype=torch.long))


# --- per-sample input --------------------------------------------------------------------------------------


def _right_pad(samples, fill=0):
    width = max(s.shape[-1] for s in samples)
    out = torch.full((*samples[0].shape[:-1], len(samples), width), fill, dtype=samples[0].dtype)
    for i, s in enumerate(samples):
        out[..., i, : s.shape[-1]] = s
    return out


def test_pack_sequences_known_case():
    b = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])], pad_to_multiple_of=2)
    assert b.tokens.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0]]
    assert b.cu_seqlens.tolist() == [0, 3, 8] and b.cu_seqlens_padded.tolist() == [0, 4, 10]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    assert b.max_seqlen == 6 and b.padding_mask.sum() == 2


def test_pack_sequences_rejects_padded_or_mismatched_input():
    with pytest.raises(ValueError, match=r"tokens\[0\] has shape \(1, 3\); expected \[3\] \(t.reshape\(-1\)"):
        pack_sequences([torch.tensor([[1, 2, 3]])])
    with pytest.raises(ValueError, match="For a padded \\[B, S\\] batch use pack_batch_sequences"):
        pack_sequences(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"labels\[1\] has shape \(3,\); expected \[2\] matching tokens\[1\]"):
        pack_sequences([torch.tensor([1]), torch.tensor([1, 2])], labels=[torch.tensor([1]), torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="labels has 1 samples but tokens has 2"):
        pack_sequences([torch.tensor([1]), torch.tensor([1, 2])], labels=[torch.tensor([1])])
    with pytest.raises(ValueError, match="all 2 samples are empty"):
        pack_sequences([torch.tensor([], dtype=torch.long)] * 2)


def test_pack_sequences_from_python_lists():
    """What a tokenised dataset yields: lists of ids, converted in one go, same result as tensors."""
    ids = [[5, 6, 7], [], [8, 9]]
    b = pack_sequences(ids, labels=[[-100, 6, 7], [], [-100, 9]], pad_to_multiple_of=2)
    t = pack_sequences([torch.tensor(x, dtype=torch.long) for x in ids],
                       labels=[torch.tensor(x, dtype=torch.long) for x in [[-100, 6, 7], [], [-100, 9]]],
                       pad_to_multiple_of=2)
    assert b.tokens.tolist() == t.tokens.tolist() == [[5, 6, 7, 0, 8, 9]]
    assert torch.equal(b.labels, t.labels) and torch.equal(b.position_ids, t.position_ids)
    assert b.cu_seqlens.tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match=r"tokens\[1\] must hold integer ids; found 3.5"):
        pack_sequences([[1, 2], [3.5]])
    with pytest.raises(ValueError, match=r"labels\[0\] must hold integer ids; found True"):
        pack_sequences([[1, 2]], labels=[[True, False]])


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    """Run a test on the CPU numpy path and on the torch path (what GPUs and exotic dtypes take)."""
    if request.param == "torch":
        monkeypatch.setattr(packing, "_numpy_ready", lambda values: False)
    return request.param


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(any),
    m=st.sampled_from([1, 2, 4]),
    channels=st.sampled_from([0, 3]),
    spare=st.sampled_from([None, 0, 8]),
)
def test_per_sample_and_torch_path_equal_the_padded_numpy_path(lengths, m, channels, spare):
    """pack_sequences(samples) and the torch path give exactly what pack_batch_sequences gives on CPU for the
    same samples right-padded (itself checked against known cases and the unpack round trip above)."""
    rng = np.random.default_rng(sum(lengths) + m)
    tokens = [torch.from_numpy(rng.integers(1, 99, size=n)) for n in lengths]
    labels = [t * 3 for t in tokens]
    loss_mask = [torch.ones(n, dtype=torch.float32) for n in lengths]
    positions = None
    if channels:
        positions = [torch.from_numpy(rng.integers(0, 50, size=(channels, n))) for n in lengths]
    width = sum(-(-n // m) * m for n in lengths)
    options = {"pad_to_multiple_of": m, "pad_to_length": None if spare is None else width + spare}

    def padded():
        return pack_batch_sequences(
            _right_pad(tokens), _right_pad(labels, -100), _right_pad(loss_mask),
            position_ids=None if positions is None else _right_pad(positions),
            padding_mask=_right_pad([torch.ones(n, dtype=torch.long) for n in lengths]), **options,
        )

    def direct():
        return pack_sequences(tokens, labels, loss_mask, positions, **options)

    reference = padded()
    results = [direct()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packing, "_numpy_ready", lambda values: False)
        results += [padded(), direct()]
    for result in results:
        for name in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded",
                     "seq_lengths", "padding_mask"):
            assert torch.equal(getattr(result, name), getattr(reference, name)), name
        assert result.max_seqlen == reference.max_seqlen


def test_known_case_on_both_paths(path):
    b = pack_batch_sequences(right_padded([3, 2]), torch.ones(2, 3, dtype=torch.long), pad_to_multiple_of=2,
                             pad_to_length=10)
    assert b.tokens.tolist() == [[1, 2, 3, 0, 4, 5, 0, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert b.padding_mask.tolist() == [[False] * 3 + [True] + [False] * 2 + [True] * 4]
    assert b.cu_seqlens_padded.tolist() == [0, 4, 6, 10] and b.cu_seqlens.tolist() == [0, 3, 5, 5]
    left = pack_batch_sequences(torch.tensor([[0, 7, 8], [9, 0, 0]]), padding_mask=torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert left.tokens.tolist() == [[7, 8, 9]]


def test_bfloat16_loss_mask_takes_the_torch_path():
    b = pack_batch_sequences(right_padded([3, 2]), loss_mask=torch.ones(2, 3, dtype=torch.bfloat16), pad_to_multiple_of=2)
    assert b.loss_mask.dtype == torch.bfloat16 and b.loss_mask.tolist() == [[1, 1, 1, 0, 1, 1]]


# --- threads -----------------------------------------------------------------------------------------------


def test_cpu_packing_runs_torch_kernels_on_one_intra_op_thread_and_restores_the_setting(monkeypatch):
    """Parallel kernels on tiny tensors stall when another core is busy (issue 15.2). Plain CPU tensors take the
    numpy path (no intra-op kernels); CPU tensors numpy cannot view (bfloat16) run torch kernels on 1 thread."""
    seen = []
    real_join = packing._join
    monkeypatch.setattr(packing, "_join", lambda *a: seen.append((type(a[0][0]), torch.get_num_threads())) or real_join(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loss_mask = torch.ones(2, 3, dtype=torch.bfloat16)
        pack_batch_sequences(right_padded([3, 2]), loss_mask=loss_mask, pad_to_multiple_of=2)
        pack_sequences([torch.tensor([1, 2])], loss_mask=[torch.ones(2, dtype=torch.bfloat16)])
        assert seen and {threads for kind, threads in seen} == {1} and {kind for kind, _ in seen} == {torch.Tensor}
        assert torch.get_num_threads() == 2
        seen.clear()
        pack_batch_sequences(right_padded([3, 2]), pad_to_multiple_of=2)
        assert {kind for kind, _ in seen} == {np.ndarray}  # the numpy path: no torch kernels to schedule
    finally:
        torch.set_num_threads(before)
