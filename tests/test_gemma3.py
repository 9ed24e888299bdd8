"""Gemma 3 packed exactly: causal + bidirectional image blocks + sliding windows, never across samples.

Reference: each sample run ALONE through the stock ``Gemma3ForConditionalGeneration`` with
``attn_implementation="sdpa"`` (transformers builds its own mask from ``token_type_ids``), loss = the model's own
shifted cross entropy (``labels=``). Packed: one row through ``enable_packing`` (our attention, per-segment SDPA on
CPU). Tiny model: 3 text layers (sliding window 6, full, sliding: the third shows a per-batch plan reused across
layers), 1 SigLIP block, 16 soft tokens per image.

Substituted (no hub here): the Gemma tokenizer is the real Qwen tokenizer with Gemma 3's special tokens added
(``vlm_pack.testing.tiny_models.gemma3_tokenizer``); the chat template is ``vlm_pack.data.chat.GEMMA_TEMPLATE`` (Gemma turn
format with ``{% generation %}`` blocks). The processor and image processor are transformers' own Gemma 3 classes.
Images come from ``skimage.data``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from skimage import data

import vlm_pack.attention.varlen as attention
import vlm_pack.integrations.hf_model as hf
import vlm_pack.data.collator as collator_module
from vlm_pack.attention.varlen import available_backends, document_block_mask, varlen_attention
from vlm_pack.data.collator import VLMPackingCollator, model_inputs
from vlm_pack.core.versions import has
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import ImageBlockRule, UnsupportedModelError, get_family
from vlm_pack.testing.tiny_models import offline_gemma3_processor, tiny_config, tiny_model

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, fp64_inputs, max_abs
LAYERS = 3


def _examples() -> list[dict]:
    """Micro-batch of 5: one image, text only, two images (different sizes), image-only question, long text."""
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": data.astronaut()},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "An astronaut in a white suit."}]},
        {"messages": [{"role": "user", "content": "Say hi, please."}, {"role": "assistant", "content": "Hi there!"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                                   {"type": "image", "image": data.chelsea()},
                                                   {"type": "image", "image": data.coffee()[:200, :300]}]},
                      {"role": "assistant", "content": "A cat and a cup of coffee."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": data.rocket()}]},
                      {"role": "assistant", "content": "A rocket on its launch pad."}]},
        {"messages": [{"role": "user", "content": "Count from one to twelve in words."},
                      {"role": "assistant", "content": "one two three four five six seven eight nine ten eleven "
                                                       "twelve"}]},
    ]


BEFORE_MASK_SHIFT = ("transformers < 5.23 does not shift the assistant mask for expanded images and Gemma 3's "
                     "expansion writes text, so the collator refuses Gemma 3 there "
                     "(test_collator_refuses_gemma3_where_transformers_does_not_shift_the_mask)")


@pytest.fixture(scope="module")
def setup():
    """Processor, stock sdpa model, packed model (same weights), the packed batch and each sample alone."""
    if not has("processor_mask_shift"):
        pytest.skip(BEFORE_MASK_SHIFT)
    processor = offline_gemma3_processor()
    stock = tiny_model("gemma3", attn_implementation="sdpa", layers=LAYERS)
    packed = enable_packing(tiny_model("gemma3", attn_implementation="sdpa", layers=LAYERS))
    examples = _examples()
    collator = VLMPackingCollator(processor, max_length=256, model_config=packed.config)
    alone = VLMPackingCollator(processor, max_length=256, model_config=stock.config, pack_sequences_in_batch=False)
    singles = [alone([example]) for example in examples]
    return processor, stock, packed, collator(examples), singles


def _stock_alone(stock, single, grad: bool = False):
    """Logits and the model's own shifted CE of one sample run alone through the stock sdpa model."""
    with torch.set_grad_enabled(grad):
        out = stock(input_ids=single["input_ids"], pixel_values=single.get("pixel_values"),
                    token_type_ids=single["token_type_ids"], labels=single["labels"], use_cache=False)
    return out.logits[0], out.loss


def _packed_pieces(model, batch, singles, grad: bool = False) -> list[torch.Tensor]:
    """Packed forward; each sample's logits cut out at its physical start (``cu_seq_lens_q``)."""
    with torch.set_grad_enabled(grad):
        logits = model(**model_inputs(batch), use_cache=False).logits[0]
    starts = batch["cu_seq_lens_q"].tolist()
    return [logits[start:start + s["input_ids"].shape[1]] for start, s in zip(starts, singles)]


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1], labels[0, 1:], ignore_index=-100)


@pytest.fixture(scope="module")
def reference(setup):
    """Each sample alone through the stock model: logits and losses; the summed loss backpropagated once."""
    _, stock, _, _, singles = setup
    stock.zero_grad()
    runs = [_stock_alone(stock, single, grad=True) for single in singles]
    sum(loss for _, loss in runs).backward()
    return [(logits.detach(), loss.detach()) for logits, loss in runs]


@pytest.fixture(scope="module")
def floor(setup, reference):
    """The stock reference's fp32 noise floors (logits, per-sample loss): each sample alone through an fp64 copy."""
    _, stock, _, _, singles = setup
    stock64 = fp64_copy(stock)
    floors = SimpleNamespace(logits=NoiseFloor("logits"), loss=NoiseFloor("per-sample loss"))
    for single, (logits, loss) in zip(singles, reference):
        logits64, loss64 = _stock_alone(stock64, fp64_inputs(single))
        floors.logits.observe(logits, logits64)
        floors.loss.observe(loss, loss64)
    return floors


@pytest.fixture(scope="module")
def packed_run(setup):
    """The packed row forward (per-sample logits) with the sum of per-sample shifted CE backpropagated once."""
    _, _, packed, batch, singles = setup
    packed.zero_grad()
    pieces = _packed_pieces(packed, batch, singles, grad=True)
    sum(_shifted_ce(got, single["labels"]) for got, single in zip(pieces, singles)).backward()
    return [piece.detach() for piece in pieces]


def _max_errors(setup, reference) -> list[float]:
    _, _, packed, batch, singles = setup
    pieces = _packed_pieces(packed, batch, singles)
    return [float((got - ref).abs().max()) for got, (ref, _) in zip(pieces, reference)]


def test_batch_has_images_of_several_sizes_multi_image_and_text_only(setup):
    _, _, _, batch, singles = setup
    images = [0 if s.get("pixel_values") is None else s["pixel_values"].shape[0] for s in singles]
    assert images == [1, 0, 2, 1, 0]
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert batch["pixel_values"].shape[0] == 4
    assert int((batch["token_type_ids"] == 1).sum()) == 4 * 16


def test_packed_logits_and_losses_equal_each_sample_alone(setup, reference, floor, packed_run):
    _, _, _, _, singles = setup
    for got, single, (ref, ref_loss) in zip(packed_run, singles, reference):
        floor.logits.check(max_abs(got, ref))
        floor.loss.check(max_abs(_shifted_ce(got, single["labels"]), ref_loss))


def test_model_own_loss_on_the_whole_batch_is_the_token_mean_of_the_samples(setup, reference, floor):
    """``model(**batch)`` (what Trainer does): the model's own whole-row shifted loss equals the token-weighted mean
    of the per-sample losses alone (first label of every sample is -100)."""
    _, _, packed, batch, singles = setup
    with torch.no_grad():
        loss = packed(**batch, use_cache=False).loss
    counts = [int((single["labels"][0, 1:] != -100).sum()) for single in singles]
    expected = sum(ref_loss * n for (_, ref_loss), n in zip(reference, counts)) / sum(counts)
    floor.loss.check(abs(float(loss - expected)))


def test_packed_gradients_equal_sum_of_samples_alone(setup, reference, packed_run):
    """Every parameter (text, SigLIP tower, projector, tied embedding) within 1e-4 relative L2. (SigLIP's key bias
    has a true gradient of 0, softmax being invariant to it: both sides hold ~1e-8 of rounding noise, compared
    absolutely.)"""
    _, stock, packed, _, _ = setup
    wanted = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    got = {name: p.grad for name, p in packed.named_parameters() if p.grad is not None and name in wanted}
    assert all(p.grad is None or not p.grad.any() for name, p in packed.named_parameters() if name not in wanted)
    assert_grads_close(got, wanted)
    assert len(got) > 40  # text layers, vision tower and projector all compared


def test_unpacked_calls_stay_exact(setup, reference, floor):
    """One sample without boundaries (dense path with blocks) and a padded batch (HF's own mask) through the
    packing-enabled model equal the stock model."""
    processor, _, packed, _, singles = setup
    with torch.no_grad():
        single, (ref, _) = singles[2], reference[2]
        got = packed(input_ids=single["input_ids"], pixel_values=single["pixel_values"],
                     token_type_ids=single["token_type_ids"], use_cache=False).logits[0]
        floor.logits.check(max_abs(got, ref))
        padded = VLMPackingCollator(processor, max_length=256, model_config=packed.config,
                                    pack_sequences_in_batch=False)(_examples()[:2])
        assert not padded["attention_mask"].all()
        logits = packed(**model_inputs(padded), use_cache=False).logits
        for row, (single, (ref, _)) in enumerate(zip(singles[:2], reference)):
            floor.logits.check(max_abs(logits[row, : single["input_ids"].shape[1]], ref), f"padded row {row}")


def test_docs_gemma_snippet_runs_as_written(setup):
    """The Gemma block of docs/attention.md, run as written, computes the token mean of each of its samples run alone through
    the stock sdpa model (same weights), within the measured fp32 noise."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "attention.md").read_text()
    [snippet] = [s for s in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "(gemma_processor" in s]
    namespace: dict = {}
    with torch.no_grad():
        exec(snippet, namespace)
    model, processor = namespace["model"], namespace["gemma_processor"]
    stock = tiny_model("gemma3", attn_implementation="sdpa")
    stock.load_state_dict(model.state_dict())
    stock64, floor = fp64_copy(stock), NoiseFloor("token-mean loss")
    alone = VLMPackingCollator(processor, max_length=4096, model_config=stock.config, pack_sequences_in_batch=False)
    total, total64, count = 0.0, 0.0, 0
    with torch.no_grad():
        for example in namespace["examples"]:
            single = alone([example])
            n = int((single["labels"][0, 1:] != -100).sum())
            total += _stock_alone(stock, single)[1] * n
            total64 += _stock_alone(stock64, fp64_inputs(single))[1] * n
            count += n
    floor.observe(total / count, total64 / count)
    floor.check(abs(float(namespace["loss"] - total / count)))


# ---------------------------------------------------------------- corruption: each rule matters


def test_corruption_image_blocks_made_causal_fails(setup, reference, floor, monkeypatch):
    monkeypatch.setattr(ImageBlockRule, "block_ids", lambda self, token_types, **_: torch.full_like(token_types, -1))
    errors = _max_errors(setup, reference)
    floor.logits.check(max(errors[1], errors[4]))  # text-only samples do not care
    assert min(errors[0], errors[2], errors[3]) > 1e-2


def test_corruption_sliding_window_dropped_fails(setup, reference, monkeypatch):
    original = hf.varlen_attention

    def no_window(*args, **kwargs):
        return original(*args, **{**kwargs, "window": None})

    monkeypatch.setattr(hf, "varlen_attention", no_window)
    assert min(_max_errors(setup, reference)) > 1e-2


def test_corruption_boundaries_dropped_fails(setup, reference, floor, boundaries_dropped):
    errors = _max_errors(setup, reference)
    floor.logits.check(errors[0])  # the first sample sees nothing before it
    assert min(errors[1:]) > 1e-2


# ---------------------------------------------------------------- GPU route (FlexAttention), recorded on CPU


def test_flex_route_builds_one_block_mask_per_layer_kind_and_batch(setup, reference, floor, monkeypatch):
    """Force the route CUDA takes (flex) with a recording fake of the compiled kernel (eager flex underneath):
    3 layers (sliding, full, sliding) -> 2 block masks built, the sliding one reused by the third layer."""
    from torch.nn.attention.flex_attention import flex_attention

    _, _, model, batch, singles = setup
    calls, builds = [], []

    def recording_flex(q, k, v, *, block_mask, scale, enable_gqa):
        calls.append({"mask": block_mask, "shape": tuple(q.shape), "dtype": q.dtype, "scale": scale, "gqa": enable_gqa})
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    def recording_build(*args, **kwargs):
        builds.append(kwargs)
        return document_block_mask(*args, **kwargs)

    real = attention._auto_backend  # rows with image blocks routed to flex, the rest as before
    monkeypatch.setattr(attention, "_auto_backend", lambda device, dtype, blocks, softcap: (
        "flex" if blocks else real(device, dtype, blocks, softcap)))
    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: recording_flex)
    monkeypatch.setattr(attention, "document_block_mask", recording_build)
    for got, (ref, _) in zip(_packed_pieces(model, batch, singles), reference):
        floor.logits.check(max_abs(got, ref), "flex route")

    total = batch["input_ids"].shape[1]
    assert len(calls) == 3 and len(builds) == 2
    assert calls[0]["mask"] is calls[2]["mask"] and calls[0]["mask"] is not calls[1]["mask"]
    assert [b["window"] for b in builds] == [(5, 5), None]  # sliding_window 6 -> 5 keys back; full layer
    assert all(b["block_ids"].shape == (total,) for b in builds)
    expected_scale = 24 ** -0.5  # query_pre_attn_scalar, not head_dim
    assert all(c["shape"] == (1, 4, total, 16) and c["dtype"] == torch.float32 and c["gqa"] for c in calls)
    assert all(abs(c["scale"] - expected_scale) < 1e-12 for c in calls)
    # A second batch gets fresh masks (the cache lives in that forward's ImageBlocks only).
    _packed_pieces(model, batch, singles)
    assert len(builds) == 4 and calls[3]["mask"] is not calls[0]["mask"]


# ---------------------------------------------------------------- attention level


def _rule_reference(q, k, v, lengths, blocks, window):
    """Dense T x T rule written out directly: same sample AND (causal OR same block) AND window."""
    total = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(total)[:, None], torch.arange(total)[None]
    allowed = (seg[:, None] == seg[None]) & ((j <= i) | ((blocks[:, None] == blocks[None]) & (blocks[:, None] >= 0)))
    if window is not None:
        allowed &= j > i - window
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1), allowed


@pytest.mark.parametrize("window", [None, 4])
def test_varlen_attention_with_image_blocks_matches_the_rule(window, monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    generator = torch.Generator().manual_seed(0)
    lengths = [9, 20, 5, 30]
    total = sum(lengths)
    cu = torch.tensor([0, 9, 29, 34, 64], dtype=torch.int32)
    blocks = torch.full((total,), -1)
    blocks[12:19], blocks[40:51], blocks[51:56] = 0, 1, 2  # two blocks back to back in the last sample
    q, k, v = (torch.randn(total, h, 8, generator=generator, dtype=torch.float64) for h in (4, 2, 2))
    want, allowed = _rule_reference(q, k, v, lengths, blocks, window)
    win = None if window is None else (window - 1, window - 1)
    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: flex_attention)
    for backend in ("sdpa_segments", "flex"):
        got = varlen_attention(q, k, v, cu, cu, 30, 30, window=win, block_ids=blocks, backend=backend)
        assert (got - want).abs().max() < 1e-12, backend
    # Block-level sparsity (small blocks): every allowed pair is in a full or partial block, full blocks are
    # entirely allowed.
    size = 4
    mask = document_block_mask(cu, cu, total, total, causal=True, window=win, block_size=size, block_ids=blocks)
    n = -(-total // size)
    partial, full = torch.zeros(n, n, dtype=torch.bool), torch.zeros(n, n, dtype=torch.bool)
    for grid, num, idx in ((partial, mask.kv_num_blocks, mask.kv_indices),
                           (full, mask.full_kv_num_blocks, mask.full_kv_indices)):
        for row in range(n):
            grid[row, idx[0, 0, row, : num[0, 0, row]].long()] = True
    pad = n * size - total
    allowed_blocks = F.pad(allowed, (0, pad, 0, pad)).view(n, size, n, size)
    assert not (allowed_blocks.any(3).any(1) & ~(partial | full)).any()
    inside = F.pad(torch.ones(total, total, dtype=torch.bool), (0, pad, 0, pad)).view(n, size, n, size)
    assert (allowed_blocks | ~inside).all(3).all(1)[full].all()


def test_varlen_kernels_refuse_image_blocks_and_auto_routes_around_them():
    status = available_backends()
    assert status["flex"].image_blocks and status["sdpa_segments"].image_blocks
    for name in ("flash_attn", "torch_varlen", "transformer_engine"):
        assert not status[name].image_blocks and "image blocks" in status[name].reason
    assert attention.select_backend("cpu", torch.bfloat16, image_blocks=True) == "sdpa_segments"
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot express bidirectional image blocks"):
        varlen_attention(q, q, q, cu, cu, 6, 6, block_ids=torch.zeros(6, dtype=torch.long), backend="flash_attn")
    with pytest.raises(ValueError, match="causal self-attention"):
        varlen_attention(q, q, q, cu, cu, 6, 6, causal=False, block_ids=torch.zeros(6, dtype=torch.long))


def test_block_ids_follow_transformers():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    token_types = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 1, 1, 0, 1]])
    rule = get_family(tiny_config("gemma3")).model.image_blocks(tiny_config("gemma3"))
    assert torch.equal(rule.block_ids(token_types), get_block_sequence_ids_for_mask(token_types))


# ---------------------------------------------------------------- refusals


def test_bidirectional_gemma3_is_refused():
    config = tiny_config("gemma3")
    config.text_config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="gemma3 model with use_bidirectional_attention=True"):
        get_family(config)


def test_gemma3_length_dependent_rope_and_unknown_layer_kinds_are_refused():
    config = tiny_config("gemma3")
    config.text_config.rope_parameters["full_attention"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match=r"rope_type \['dynamic'\]"):
        get_family(config)
    config = tiny_config("gemma3")
    config.text_config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match=r"layer types \['chunked_attention'\]"):
        get_family(config)


def test_pixel_values_without_token_type_ids_are_refused(setup):
    _, _, packed, batch, _ = setup
    inputs = {key: value for key, value in model_inputs(batch).items() if key != "token_type_ids"}
    with pytest.raises(ValueError, match="pixel_values without token_type_ids"):
        packed(**inputs, use_cache=False)


def test_context_parallel_is_refused(setup):
    processor, _, packed, _, _ = setup
    with pytest.raises(ValueError, match="context_parallel_size=2 with a gemma3 model: bidirectional image blocks"):
        VLMPackingCollator(processor, max_length=256, model_config=packed.config, context_parallel_size=2)


def test_collator_refuses_gemma3_where_transformers_does_not_shift_the_mask(monkeypatch):
    """Gemma 3's processor writes blank lines around each image, so the collator cannot carry the unexpanded chat's
    assistant mask through the expansion; before transformers 5.23 (no shifted mask) it refuses at construction."""
    monkeypatch.setattr(collator_module, "has", lambda gap: gap != "processor_mask_shift" and has(gap))
    with pytest.raises(ValueError, match=r"gemma3 processor writes text .* pip install -U 'transformers>=5\.23'"):
        VLMPackingCollator(offline_gemma3_processor(), max_length=256, model_config=tiny_config("gemma3"))
