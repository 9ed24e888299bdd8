"""bf16 on the CPU packed paths (autocast over fp32 weights, and bf16 weights): a packed row through
``enable_packing`` against each sample run alone through the stock sdpa model in fp32 (the reference).

Bound: the packed bf16 run may be no further from the fp32 reference than the ordinary bf16 way of batching the
same samples (right-padded rows with an attention mask through the stock sdpa model); the corruption (one
segment over the whole row: samples attend across boundaries) must break that bound.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [9, 23, 1, 16]  # includes a 1-token sample; >= 2 samples per row (the case that crashed)


def make_models(family: str, bf16_weights: bool):
    reference = tiny_model(family, layers=2, vocab_size=512)
    stock = tiny_model(family, layers=2, vocab_size=512)
    packed = enable_packing(tiny_model(family, layers=2, vocab_size=512))
    if bf16_weights:
        stock, packed = stock.to(torch.bfloat16), packed.to(torch.bfloat16)
    return reference, stock, packed


def samples_and_row(lengths: list[int]):
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 512, (1, n), generator=generator) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    row = {"input_ids": torch.cat(samples, dim=1),
           "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
           "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return samples, row


def padded_logits(model, samples) -> list[torch.Tensor]:
    """The stock way to batch: right-padded rows with an attention mask."""
    width = max(s.shape[1] for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :s.shape[1]], mask[i, :s.shape[1]] = s[0], 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [logits[i, :s.shape[1]] for i, s in enumerate(samples)]


def error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((g.float() - r).abs().max().item() for g, r in zip(got, ref))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])  # plain attention; hybrid with Gated DeltaNet
@pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16_weights"])
def test_packed_bf16_is_no_worse_than_padded_bf16(family, bf16_weights):
    reference, stock, packed = make_models(family, bf16_weights)
    samples, row = samples_and_row(LENGTHS)
    autocast = contextlib.nullcontext() if bf16_weights else torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = [reference(input_ids=s, use_cache=False).logits[0] for s in samples]
        with autocast:
            padded = padded_logits(stock, samples)
            out = packed(**row, use_cache=False).logits[0]
            whole = len(row["input_ids"][0])
            one_segment = torch.tensor([0, whole], dtype=torch.int32)  # corruption: boundaries ignored
            crossed = packed(**{**row, "cu_seq_lens_q": one_segment, "cu_seq_lens_k": one_segment,
                                "max_length_q": whole, "max_length_k": whole}, use_cache=False).logits[0]
    assert out.dtype == torch.bfloat16
    packed_err, padded_err = error(out.split(LENGTHS), ref), error(padded, ref)
    assert packed_err <= padded_err * 1.25, (packed_err, padded_err)
    assert error(crossed.split(LENGTHS), ref) > 2 * padded_err


def test_packed_bf16_backward_under_autocast():
    """Training step under autocast (what Trainer(bf16=True) does on CPU): finite gradients on every weight."""
    _, _, packed = make_models("qwen3_5_text", bf16_weights=False)
    samples, row = samples_and_row(LENGTHS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = packed(**row, use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in packed.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
