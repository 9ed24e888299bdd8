"""Rules that a mutation sweep (42 hand-made bugs) showed no test pinned down (issue 12.9), one test each.

Expected values are computed here from the definitions (lengths, boundaries, token ids), not with the library.
Other gaps of the same sweep are closed where their code is tested: ``grad_sync="mean"`` in test_distributed.py,
GQA and the GPU kernel calls in test_attention.py, the stock-model reference in test_vlm_equivalence.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm_pack import get_packed_seq_params, pack_batch_sequences


# --------------------------------------------------- max_seqlen covers a pad_to_length fill longer than any sample


@pytest.mark.parametrize("lengths,multiple,pad_to_length", [([3, 2], 1, 20), ([3, 5], 4, 32)])
def test_max_seqlen_covers_a_long_fill_segment(lengths, multiple, pad_to_length):
    """A varlen kernel sizes its work by max_seqlen: the trailing fill segment is one of the segments it sees."""
    width = max(lengths)
    tokens = torch.tensor([[7] * n + [0] * (width - n) for n in lengths])
    packed = pack_batch_sequences(tokens, pad_to_multiple_of=multiple, pad_to_length=pad_to_length)
    aligned = [-(-n // multiple) * multiple for n in lengths]
    fill = pad_to_length - sum(aligned)
    assert fill > max(aligned)  # the case of the sweep: the fill is the longest segment
    assert packed.cu_seqlens_padded.tolist() == np.cumsum([0, *aligned, fill]).tolist()
    assert packed.max_seqlen == fill == int(packed.cu_seqlens_padded.diff().max())
    assert packed.attention_kwargs()["max_length_q"] == fill
    assert get_packed_seq_params(packed).max_seqlen_q == fill


# ----------------------------------------------------------- an image inside an assistant turn gets no labels


def test_image_inside_an_assistant_turn_gets_no_labels(collator, processor):
    from vlm_pack.testing.data import sample_photos

    photo = sample_photos(56)["chelsea"]
    answer = "A cat, sitting."
    example = {"messages": [
        {"role": "user", "content": "Show me a cat."},
        {"role": "assistant", "content": [{"type": "image", "image": photo}, {"type": "text", "text": answer}]},
    ]}
    batch = collator([example, {"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello."}]}])
    tokenizer = processor.tokenizer
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    start, end = batch["cu_seq_lens_q"][:2].tolist()
    ids, labels = batch["input_ids"][0, start:end], batch["labels"][0, start:end]
    assert (ids == image_pad).sum() > 0
    assert (labels[ids == image_pad] == -100).all(), "image tokens in an assistant turn must not be targets"
    assert tokenizer.decode(ids[labels != -100]).endswith(answer + "<|im_end|>\n")  # the reply text is still learned


# ------------------------------------- prepare with pad_seq_to_mult > 1: the packs open and collate aligned


def test_prepare_with_pad_seq_to_mult_opens_and_collates_aligned(aligned_packs):
    from vlm_pack.offline import PackedSFTDataset

    """``aligned_packs`` (conftest.py) ran prepare with pad_seq_to_mult=4 and pack size 128."""
    dataset = PackedSFTDataset(aligned_packs["training"], 128, metadata=aligned_packs["metadata"], pad_seq_to_mult=4,
                               pad_to_max_length=True)
    unaligned_samples = 0
    for index in range(len(dataset)):
        item = dataset[index]
        starts = np.flatnonzero(np.asarray(item["position_ids"]) == 0)  # positions restart at every sample
        lengths = np.diff(np.append(starts, len(item["input_ids"]))).tolist()
        aligned = [-(-n // 4) * 4 for n in lengths]
        assert sum(aligned) <= 128, f"pack {index} does not fit once its samples are aligned"
        unaligned_samples += sum(n % 4 != 0 for n in lengths)
        batch = dataset.collate_fn([item])
        meta = batch["vlm_pack"]
        physical = meta["cu_seqlens"][0, : int(meta["cu_seqlens_argmin"])].tolist()
        real = meta["cu_seqlens_unpadded"][0, : int(meta["cu_seqlens_unpadded_argmin"])].tolist()
        assert batch["cu_seq_lens_q"].tolist() == physical
        fill = [128 - sum(aligned)] if sum(aligned) < 128 else []
        assert physical == np.cumsum([0, *aligned, *fill]).tolist()
        assert real == np.cumsum([0, *lengths, *[0] * len(fill)]).tolist()
        assert all(b % 4 == 0 for b in physical)
        tokens, labels, positions = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
        assert tokens.shape == (128,)
        offsets = np.cumsum([0, *lengths])
        for i, (n, start) in enumerate(zip(lengths, physical)):
            sample = torch.as_tensor(item["input_ids"][offsets[i] : offsets[i] + n])
            assert torch.equal(tokens[start : start + n], sample)
            assert positions[start : start + n].tolist() == list(range(n))
            assert (labels[start + n : start + aligned[i]] == -100).all()  # alignment slots are never targets
        params = get_packed_seq_params(batch)
        assert params.cu_seqlens_q.tolist() == real and params.cu_seqlens_q_padded.tolist() == physical
    assert unaligned_samples > 0  # the data exercises alignment
