"""Rules of the collator's data path that small slips break silently; each test fails on one such slip.

Slips covered (each planted once and seen to fail here): first labels masked at the real instead of the physical
sample starts with context parallelism; ``mask_first_labels`` skipping a row's first sample; a sample of exactly
``max_length`` tokens refused; ``<image>`` placeholders filled with a multi-image sample's pictures out of order;
the CPU per-segment attention batching equal-length segments without looking at which hold an image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vlm_pack.attention.varlen import varlen_attention
from vlm_pack.core.batch import mask_first_labels
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import photo_examples, text_chat_examples

IGNORE = -100


def _alone(processor, config, example) -> torch.Tensor:
    """The sample's labels collated alone as an ordinary (unpacked) batch of one."""
    return VLMPackingCollator(processor, max_length=4096, model_config=config, pack_sequences_in_batch=False)(
        [example])["labels"][0]


def test_first_labels_are_masked_at_the_physical_sample_starts(processor, qwen2_config):
    """With context_parallel_size=2 every sample is padded to a multiple of 4: each sample's labels sit at its
    PHYSICAL offset exactly as when collated alone, padding slots carry none (masking at the real boundaries
    would erase a real target of the previous sample)."""
    examples = text_chat_examples(4, seed=3) + photo_examples(2, seed=3, max_side=56)
    collator = VLMPackingCollator(processor, max_length=4096, model_config=qwen2_config, context_parallel_size=2)
    batch = collator(examples)
    meta = batch["vlm_pack"]
    starts, lengths = meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist()
    assert meta["cu_seqlens"].tolist() != meta["cu_seqlens_padded"].tolist()  # padding moved the boundaries
    expected = torch.full_like(batch["labels"][0], IGNORE)
    for example, start, length in zip(examples, starts, lengths):
        alone = _alone(processor, qwen2_config, example)
        assert len(alone) == length
        expected[start:start + length] = alone
    assert torch.equal(batch["labels"][0], expected)


def test_mask_first_labels_masks_every_start_including_the_rows_first():
    labels = torch.arange(10).unsqueeze(0)
    out = mask_first_labels(labels.clone(), torch.tensor([0, 3, 7]))
    want = labels.clone()
    want[0, [0, 3, 7]] = IGNORE
    assert torch.equal(out, want)


ANSWER_FIRST = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
                "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")


def test_a_sample_opening_with_an_answer_has_no_first_target(processor):
    """A template that labels a sample's very first token: the collator still puts -100 at every sample start,
    the row's first included, in packed and padded mode."""
    tokenizer = processor.tokenizer
    examples = [{"messages": [{"role": "assistant", "content": f"Hello {i}"}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Bye"}]} for i in range(3)]
    packed = VLMPackingCollator(tokenizer, max_length=64, chat_template=ANSWER_FIRST)(examples)
    starts = packed["vlm_pack"]["cu_seqlens_padded"][:-1]
    assert (packed["labels"][0, starts] == IGNORE).all() and (packed["labels"][0, starts + 1] != IGNORE).all()
    padded = VLMPackingCollator(tokenizer, max_length=64, chat_template=ANSWER_FIRST,
                                pack_sequences_in_batch=False)(examples)
    assert (padded["labels"][:, 0] == IGNORE).all() and (padded["labels"][:, 1] != IGNORE).all()


def test_a_sample_of_exactly_max_length_is_kept(processor, qwen2_config):
    example = photo_examples(1, seed=4, max_side=56)[0]
    length = VLMPackingCollator(processor, max_length=4096, model_config=qwen2_config)([example])["input_ids"].shape[1]
    exact = VLMPackingCollator(processor, max_length=length, model_config=qwen2_config)([example])
    assert exact["input_ids"].shape[1] == length
    with pytest.raises(ValueError, match=f"has {length} tokens .* > max_length={length - 1}"):
        VLMPackingCollator(processor, max_length=length - 1, model_config=qwen2_config)([example])


def test_image_placeholders_take_the_pictures_in_order(processor, qwen2_config):
    """"<image>...<image>" with two pictures of different sizes: the first placeholder gets images[0]; pixel
    rows and grids equal the image processor's own output for [first, second]."""
    small = Image.fromarray(np.full((56, 56, 3), 40, dtype=np.uint8))
    large = Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 84, 3), dtype=np.uint8))
    example = {"messages": [{"role": "user", "content": "<image>left, <image>right: which is larger?"},
                            {"role": "assistant", "content": "The right one."}], "images": [small, large]}
    batch = VLMPackingCollator(processor, max_length=4096, model_config=qwen2_config)([example])
    direct = processor.image_processor(images=[small, large], return_tensors="pt")
    assert direct["image_grid_thw"][0].tolist() != direct["image_grid_thw"][1].tolist()
    assert torch.equal(batch["image_grid_thw"], direct["image_grid_thw"])
    assert torch.equal(batch["pixel_values"], direct["pixel_values"])


def _reference_attention(q, k, v, blocks):
    """One segment: causal OR same image block, plain SDPA with an explicit boolean mask."""
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=causal | same)
    return out.transpose(0, 1)


def test_cpu_segments_of_equal_length_keep_their_own_image_blocks():
    """Three segments of 8 tokens (text-only first, then two with images at different places) batched by the
    CPU per-segment path: each equals its own reference (grouping by length alone would drop the blocks of the
    image segments, or give them the first segment's)."""
    torch.manual_seed(0)
    heads, dim, n = 2, 8, 8
    q, k, v = (torch.randn(3 * n, heads, dim) for _ in range(3))
    blocks = torch.full((3 * n,), -1)
    blocks[n + 2:n + 6] = 0
    blocks[2 * n + 1:2 * n + 4] = 1
    cu = torch.tensor([0, n, 2 * n, 3 * n], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, cu, n, n, backend="sdpa_segments", block_ids=blocks)
    for s in range(3):
        part = slice(s * n, (s + 1) * n)
        ref = _reference_attention(q[part], k[part], v[part], blocks[part])
        assert (out[part] - ref).abs().max() < 1e-5, s
