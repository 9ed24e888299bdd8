"""``torch.compile`` of a packed model (CPU): it traces (no numpy in the attention path), is exact against each
sample run alone through the stock sdpa model, and a fixed-width row stops recompiling once the segment count
has gone dynamic. The ``aot_eager`` backend traces forward and backward like inductor without its codegen
(benchmarks/compile.py times the inductor build)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from vlm_pack import pack_batch_sequences
from vlm_pack.attention import varlen as attention
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH = 48
# Fixed-width rows (pad_to_length): a different number and length of samples each time, a fill segment at the end.
BATCHES = [[20, 5, 9], [2, 6, 2, 1, 1, 30], [7, 7, 7, 7]]
LOGIT_ATOL = 1e-4
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def models():
    reference = tiny_model("qwen3", layers=2, vocab_size=256)
    packed = enable_packing(tiny_model("qwen3", layers=2, vocab_size=256))
    return reference, packed


def fixed_width_row(lengths: list[int]):
    generator = torch.Generator().manual_seed(sum(lengths) * len(lengths))
    samples = [torch.randint(1, 256, (n,), generator=generator) for n in lengths]
    padded = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    mask = (torch.arange(padded.shape[1]) < torch.tensor(lengths)[:, None]).long()
    packed = pack_batch_sequences(padded, attention_mask=mask, pad_to_length=WIDTH)
    row = {"input_ids": packed.tokens, "position_ids": packed.position_ids, **packed.attention_kwargs()}
    return samples, row


def reference_run(reference, samples):
    """Each sample alone through the stock model: logits, and grads of the summed per-sample token-mean logsumexp."""
    reference.zero_grad()
    logits = []
    for ids in samples:
        out = reference(input_ids=ids[None], use_cache=False).logits[0]
        (out.logsumexp(-1).mean()).backward()
        logits.append(out.detach())
    return logits, {n: p.grad.clone() for n, p in reference.named_parameters()}


def packed_run(model, row, lengths):
    model.zero_grad()
    out = model(**row, use_cache=False).logits[0]
    per_sample = out[:sum(lengths)].split(lengths)
    sum(x.logsumexp(-1).mean() for x in per_sample).backward()
    model = getattr(model, "_orig_mod", model)  # a compiled wrapper prefixes the parameter names
    return [x.detach() for x in per_sample], {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_exact(got, expected):
    (logits, grads), (ref_logits, ref_grads) = got, expected
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() <= GRAD_RTOL * ref_grads[name].norm(), name


def test_compiled_packed_model_is_exact_and_stops_recompiling(models):
    reference, packed = models
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(packed, backend=counter, fullgraph=True)  # fullgraph: no graph break in our code
    frames = []
    for lengths in BATCHES:
        samples, row = fixed_width_row(lengths)
        assert_exact(packed_run(compiled, row, lengths), reference_run(reference, samples))
        frames.append(counter.frame_count)
    # The first batch compiles; the second (another segment count) makes that count dynamic, once per compiled
    # frame (the forward, and enable_packing's forward pre-hook, which dynamo traces as a frame of its own); then no
    # batch recompiles anything.
    assert frames[0] == 1 and frames[1] <= 3 and frames[2:] == [frames[1]] * (len(frames) - 2), frames
    torch._dynamo.reset()


def test_compiled_path_uses_the_segment_mask(models, monkeypatch):
    """Corruption: a compiled row mask that ignores segment boundaries must break exactness."""
    reference, packed = models
    real = attention._allowed
    monkeypatch.setattr(attention, "_allowed", lambda sq, sk, *a: real(sq * 0, sk * 0, *a))
    torch._dynamo.reset()
    compiled = torch.compile(packed, backend="eager", fullgraph=True)
    lengths = BATCHES[0]
    samples, row = fixed_width_row(lengths)
    with torch.no_grad():
        out = compiled(**row, use_cache=False).logits[0][:sum(lengths)].split(lengths)
        ref = [reference(input_ids=ids[None], use_cache=False).logits[0] for ids in samples]
    assert max((a - b).abs().max().item() for a, b in zip(out, ref)) > 100 * LOGIT_ATOL
    torch._dynamo.reset()
