"""Hybrid linear-attention models (Qwen3.5): a packed row equals each sample run alone through the stock model.

The reference is the stock model (``attn_implementation="sdpa"``, transformers' own torch DeltaNet path), one
sample per forward, no padding, loss the plain HF way (shifted cross entropy on that sample). The packed side
runs the same weights with ``enable_packing`` and the linear-attention packing installed. fp32 CPU: per-token
loss, logits and gradients. Corruptions (recurrent state carried across a boundary, conv
window leaking into the next sample) must break the comparison. Tolerances: ``tests/tolerance.py`` (logits and
losses within 16x the stock model's own fp32-vs-fp64 gap on the same samples; gradients 1e-4 relative L2). The GPU route is checked with recording fakes
of flash-linear-attention's functions in ``sys.modules``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from vlm_pack.attention import gated_deltanet as gd
from vlm_pack.attention import linear as la
from vlm_pack.data.collator import VLMPackingCollator, model_inputs
from vlm_pack.testing.data import photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.attention.packed_layers import install_linear_attention_packing, remove_linear_attention_packing
from vlm_pack.models import get_family
from vlm_pack.testing.tiny_models import tiny_config, tiny_model

from fla_fakes import install_fake_fla
from tolerance import NoiseFloor, assert_grads_close, fp64_copy, fp64_inputs, max_abs

DELTANET = ["Qwen3_5GatedDeltaNet"]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ text model (Qwen3_5ForCausalLM)


def text_batch(lengths: list[int], seed: int) -> tuple[list[torch.Tensor], dict]:
    """Random samples and their packed row (ids, per-sample positions, boundary kwargs)."""
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, 5000, (1, n), generator=generator) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    row = {
        "input_ids": torch.cat(samples, dim=1),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
    }
    return samples, row


def sample_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain HF causal-LM loss of one sample: mean shifted cross entropy."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def small_vocab_text_model(family: str = "qwen3_5_text") -> torch.nn.Module:
    """Tiny hybrid text model, 3 layers (linear, full, linear), 5000-token vocabulary, same weights every call."""
    return tiny_model(family, layers=3, vocab_size=5000)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def text_models(request):
    """Stock reference, its fp64 copy and the packed model, same weights (3 layers: linear, full, linear)."""
    reference, model = small_vocab_text_model(request.param), small_vocab_text_model(request.param)
    enable_packing(model)
    return reference, model, fp64_copy(reference)


# Lengths cross the 64-token chunk size (several chunks, several buckets) and include a 1-token sample.
@pytest.mark.parametrize(
    "lengths",
    [[9, 17], [70, 5, 33], [1, 64, 65, 12], [130, 3, 40, 7, 66], [6, 6, 6, 6, 6, 6]],
    ids=lambda x: f"mb{len(x)}",
)
def test_packed_text_equals_each_sample_alone(text_models, lengths):
    reference, model, reference64 = text_models
    samples, row = text_batch(lengths, seed=len(lengths))
    logit_floor, loss_floor = NoiseFloor("logits"), NoiseFloor("loss")

    reference.zero_grad()
    ref_logits, ref_losses = [], []
    for ids in samples:
        logits = reference(input_ids=ids, use_cache=False).logits
        loss = sample_loss(logits, ids) if ids.shape[1] > 1 else logits.sum() * 0
        (loss / len(samples)).backward()
        with torch.no_grad():
            logits64 = reference64(input_ids=ids, use_cache=False).logits
            loss64 = sample_loss(logits64, ids) if ids.shape[1] > 1 else logits64.sum() * 0
        logit_floor.observe(logits, logits64)
        loss_floor.observe(loss, loss64)
        ref_logits.append(logits[0].detach())
        ref_losses.append(loss.detach())
    ref_grads = grads(reference)

    model.zero_grad()
    logits = model(**row, use_cache=False).logits
    per_sample = logits[0].split(lengths)
    losses = [sample_loss(lg.unsqueeze(0), ids) if ids.shape[1] > 1 else lg.sum() * 0
              for lg, ids in zip(per_sample, samples)]
    loss = torch.stack(losses).mean()
    loss.backward()

    logit_floor.check(max(max_abs(p, r) for p, r in zip(per_sample, ref_logits)))
    loss_floor.check(max(max_abs(p, r) for p, r in zip(losses, ref_losses)), "per-sample loss")
    assert_grads_close(grads(model), ref_grads)


def packed_logit_error(models, lengths, seed=0) -> tuple[float, NoiseFloor]:
    """Largest |packed - stock fp32| logit gap over the samples, and the logits' measured fp32 noise floor."""
    reference, model, reference64 = models
    samples, row = text_batch(lengths, seed)
    floor = NoiseFloor("logits")
    with torch.no_grad():
        ref = [reference(input_ids=ids, use_cache=False).logits[0] for ids in samples]
        for ids, logits in zip(samples, ref):
            floor.observe(logits, reference64(input_ids=ids, use_cache=False).logits[0])
        out = model(**row, use_cache=False).logits[0].split(lengths)
    return max(max_abs(p, r) for p, r in zip(out, ref)), floor


def whole_row_layout(lengths: list[int]) -> la.SegmentLayout:
    """The layout of ONE sample spanning the row: what a path that ignores boundaries computes."""
    return la.SegmentLayout.from_cu_seqlens(torch.tensor([0, sum(lengths)]), sum(lengths))


def test_state_carried_across_boundaries_is_caught(text_models, monkeypatch):
    """Corruption: the delta rule over the whole row (state not reset at boundaries) must break exactness."""
    lengths = [40, 30, 20]
    error, floor = packed_logit_error(text_models, lengths)
    floor.check(error)
    exact, whole_row = gd.segmented_gated_delta_rule, whole_row_layout(lengths)

    def carried(q, k, v, g, beta, layout):
        return exact(q, k, v, g, beta, whole_row)

    monkeypatch.setattr(gd, "segmented_gated_delta_rule", carried)
    assert floor.is_far(packed_logit_error(text_models, lengths)[0])


def test_conv_window_leaking_across_boundaries_is_caught(text_models, monkeypatch):
    """Corruption: the conv run over the whole row (previous sample's last K-1 tokens leak in) breaks exactness."""
    lengths = [40, 30, 20]
    error, floor = packed_logit_error(text_models, lengths)
    floor.check(error)
    exact, whole_row = la.segmented_causal_conv1d, whole_row_layout(lengths)

    def leaky(hidden, weight, bias, activation, layout):
        return exact(hidden, weight, bias, activation, whole_row)

    monkeypatch.setattr(la, "segmented_causal_conv1d", leaky)
    assert floor.is_far(packed_logit_error(text_models, lengths)[0])


def test_stock_model_cannot_pack_and_remove_restores(text_models):
    """Without vlm_pack's layers the stock model cannot keep a packed row's samples apart: transformers >= 5.24
    refuses on CPU, 5.17 runs the recurrence across the samples (far from each sample alone). Installing again
    brings back exactness."""
    _, model, _ = text_models
    lengths = [40, 30]
    assert remove_linear_attention_packing(model) == 2
    try:
        error, floor = packed_logit_error(text_models, lengths)
        assert floor.is_far(error), (error, floor.tolerance)
    except ValueError as refusal:
        assert "can't keep packed sequences apart" in str(refusal)
    finally:
        enable_packing(model)
    error, floor = packed_logit_error(text_models, lengths)
    floor.check(error)


def test_unpacked_forward_is_untouched(text_models):
    """Calls without boundaries (ordinary batches) take the stock layer forward: same logits."""
    reference, model, _ = text_models
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                                   reference(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-5)


def test_context_parallel_shard_is_refused(text_models):
    """A cp rank holds part of each sample while cu_seq_lens stays global: refused, naming cp."""
    _, model, _ = text_models
    _, row = text_batch([8, 8], seed=1)
    row["input_ids"] = row["input_ids"][:, :8]
    row["position_ids"] = row["position_ids"][:, :8]
    with torch.no_grad(), pytest.raises(ValueError, match="context_parallel_size=1"):
        model(**row, use_cache=False)


def test_packed_row_with_cache_is_refused(text_models):
    _, model, _ = text_models
    _, row = text_batch([4, 4], seed=2)
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        model(**row, use_cache=True)


# ------------------------------------------------------------------ GPU route (flash-linear-attention), faked


@pytest.fixture
def fake_fla(monkeypatch):
    return install_fake_fla(monkeypatch)


def test_fla_route_passes_int32_cu_seqlens(fake_fla):
    rule, conv = fake_fla
    model = small_vocab_text_model()
    enable_packing(model)
    install_linear_attention_packing(model, DELTANET, backend="fla")
    lengths = [7, 12, 5]
    _, row = text_batch(lengths, seed=4)
    row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = row["cu_seq_lens_q"].long()  # int64 in: int32 out
    with torch.no_grad():
        model(**row, use_cache=False)

    deltanet = model.model.layers[0].linear_attn
    assert len(rule.calls) == len(conv.calls) == 2  # two linear layers of 3
    for call in (rule.calls[0], conv.calls[0]):
        assert call["cu_seqlens"].dtype == torch.int32
        assert call["cu_seqlens"].tolist() == [0, 7, 19, 24]
    q, k, v = rule.calls[0]["args"]
    assert q.shape == (1, 24, deltanet.num_k_heads, deltanet.head_k_dim)
    assert v.shape == (1, 24, deltanet.num_v_heads, deltanet.head_v_dim)
    assert rule.calls[0]["g"].shape == rule.calls[0]["beta"].shape == (1, 24, deltanet.num_v_heads)
    assert rule.calls[0]["use_qk_l2norm_in_kernel"] is True
    assert rule.calls[0]["initial_state"] is None and rule.calls[0]["output_final_state"] is False
    (x,) = conv.calls[0]["args"]
    assert x.shape == (1, 24, deltanet.conv_dim)  # fla's [B, T, D] layout
    assert conv.calls[0]["weight"].shape == (deltanet.conv_dim, deltanet.conv_kernel_size)
    assert conv.calls[0]["activation"] == "silu"


def test_auto_backend_keeps_cpu_on_torch_path(fake_fla):
    """fla installed but tensors on CPU: "auto" takes the exact torch path (fla's kernels are Triton/CUDA)."""
    rule, conv = fake_fla
    assert la.select_linear_backend("cpu") == "torch_segments"
    model = small_vocab_text_model()
    enable_packing(model)
    _, row = text_batch([5, 9], seed=5)
    with torch.no_grad():
        model(**row, use_cache=False)
    assert rule.calls == [] and conv.calls == []


def test_fla_backend_without_fla_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    model = small_vocab_text_model()
    enable_packing(model)
    install_linear_attention_packing(model, DELTANET, backend="fla")
    _, row = text_batch([5, 9], seed=6)
    with torch.no_grad(), pytest.raises(ImportError, match="torch_segments"):
        model(**row, use_cache=False)


# ------------------------------------------------------------------ VLM (Qwen3_5ForConditionalGeneration)


@pytest.fixture(scope="module")
def vlm_models():
    reference = tiny_model("qwen3_5", layers=3)
    model = tiny_model("qwen3_5", layers=3)
    enable_packing(model)
    return reference, model, fp64_copy(reference)


def vlm_reference(model, model64, processor, examples):
    """Each sample alone through the stock model, positions left to the model: logits and per-token losses, and
    their fp32 noise floors (the same samples through the fp64 copy)."""
    alone = VLMPackingCollator(processor, max_length=1024, pack_sequences_in_batch=False, model_config=model.config)
    all_logits, all_losses = [], []
    logit_floor, loss_floor = NoiseFloor("logits"), NoiseFloor("per-token loss")
    for example in examples:
        single = alone([example])
        inputs = {k: v for k, v in model_inputs(single).items() if k not in ("attention_mask", "position_ids")}
        labels = single["labels"][0]
        logits = model(**inputs, use_cache=False).logits[0]
        losses = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")
        with torch.no_grad():
            logits64 = model64(**fp64_inputs(inputs), use_cache=False).logits[0]
            losses64 = torch.nn.functional.cross_entropy(logits64[:-1], labels[1:], ignore_index=-100,
                                                         reduction="none")
        logit_floor.observe(logits, logits64)
        loss_floor.observe(losses, losses64)
        all_logits.append(logits)
        all_losses.append(losses)
    return all_logits, all_losses, logit_floor, loss_floor


def image_count(example: dict) -> int:
    return sum(part.get("type") == "image" for message in example["messages"] if isinstance(message["content"], list)
               for part in message["content"])


# Images of several sizes (1-3 per sample) and a text-only sample. Gradients at micro-batch 3; at 6 the logits
# and losses only (the 150k-token vocabulary makes every backward pass cost seconds on CPU).
@pytest.mark.parametrize(("micro_batch", "check_grads"), [(3, True), (6, False)])
def test_packed_vlm_equals_each_sample_alone(vlm_models, processor, micro_batch, check_grads):
    reference, model, reference64 = vlm_models
    examples = photo_examples(micro_batch - 1, seed=micro_batch, max_side=84)
    examples.insert(1, text_chat_examples(1, seed=micro_batch)[0])
    images = [image_count(example) for example in examples]
    assert min(images) == 0 and max(images) >= 2, images

    collator = VLMPackingCollator(processor, max_length=1024, model_config=model.config)
    batch = collator(examples)
    assert batch["image_grid_thw"].shape[0] == sum(images)
    n_tokens = int((batch["labels"] != -100).sum())

    with torch.set_grad_enabled(check_grads):
        reference.zero_grad()
        ref_logits, ref_losses, logit_floor, loss_floor = vlm_reference(reference, reference64, processor, examples)
        model.zero_grad()
        logits = model(**model_inputs(batch), use_cache=False).logits[0]
        starts = batch["vlm_pack"]["cu_seqlens_padded"][:-1].tolist()
        lengths = batch["vlm_pack"]["seq_lengths"].tolist()
        labels = batch["labels"][0]
        total = 0.0
        for start, length, ref_logit, ref_loss in zip(starts, lengths, ref_logits, ref_losses):
            seg = logits[start:start + length]
            logit_floor.check(max_abs(seg, ref_logit), f"sample at {start}")
            loss = torch.nn.functional.cross_entropy(seg[:-1], labels[start + 1:start + length], ignore_index=-100,
                                                     reduction="none")
            loss_floor.check(max_abs(loss, ref_loss), f"sample at {start}")
            total = total + loss.sum()
    if check_grads:
        torch.cat(ref_losses).sum().div(n_tokens).backward()
        ref_grads = grads(reference)
        (total / n_tokens).backward()
        assert_grads_close(grads(model), ref_grads)


# ------------------------------------------------------------------ family registry and refusals


@pytest.mark.parametrize(("family", "deltanet"), [("qwen3_5", "Qwen3_5GatedDeltaNet"),
                                                  ("qwen3_5_text", "Qwen3_5GatedDeltaNet"),
                                                  ("qwen3_next", "Qwen3NextGatedDeltaNet")])
def test_enable_packing_installs_on_every_deltanet(family, deltanet):
    model = enable_packing(tiny_model(family, layers=3, vocab_size=512))
    assert get_family(model.config).name == family
    modules = [m for m in model.modules() if type(m).__name__ == deltanet]
    assert len(modules) == 2 and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in modules)


def test_context_parallel_is_refused_by_the_collator(processor):
    config = tiny_config("qwen3_5")
    get_family(config)  # refused (a skip) where transformers predates the family's proof
    with pytest.raises(ValueError, match="context_parallel_size=2 with a qwen3_5 model.*state hand-off"):
        VLMPackingCollator(processor, max_length=512, model_config=config, context_parallel_size=2)
    VLMPackingCollator(processor, max_length=512, model_config=config)  # cp=1 is fine


def test_packed_row_without_boundary_kwargs_is_refused(text_models):
    """Position ids alone (no cu_seq_lens_q) would let the DeltaNet run across samples: refused, not guessed."""
    _, model, _ = text_models
    _, row = text_batch([6, 5], seed=7)
    with torch.no_grad():
        with pytest.raises(ValueError, match="without cu_seq_lens_q"):
            model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False)
        model(input_ids=row["input_ids"], use_cache=False)  # one unpacked sequence: fine


def test_one_layout_per_forward(text_models, monkeypatch):
    """Every linear layer of a forward shares one host-side plan (one device sync per forward, not per layer)."""
    _, model, _ = text_models
    built = []
    original = la.SegmentLayout.from_cu_seqlens
    monkeypatch.setattr(la.SegmentLayout, "from_cu_seqlens", lambda cu, total: built.append(1) or original(cu, total))
    _, row = text_batch([9, 4, 11], seed=8)
    with torch.no_grad():
        model(**row, use_cache=False)
    assert len(built) == 1


def test_left_padded_single_row_is_not_mistaken_for_a_packed_row(text_models):
    """Position ids that restart because of left padding come with an attention mask: no refusal, stock result."""
    reference, model, _ = text_models
    ids = torch.randint(0, 5000, (1, 10), generator=torch.Generator().manual_seed(9))
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        ref = reference(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(out[:, 3:], ref[:, 3:], rtol=0, atol=1e-5)


def test_deepcopy_of_a_packed_model_runs_its_own_weights(text_models):
    """The installed forward is a bound method: a deep copy (EMA, reference model) uses the copy's weights."""
    import copy

    _, model, _ = text_models
    clone = copy.deepcopy(model)
    deltanet = clone.model.layers[0].linear_attn
    assert deltanet.forward.__self__ is deltanet
    _, row = text_batch([7, 9], seed=10)
    with torch.no_grad():
        torch.testing.assert_close(clone(**row, use_cache=False).logits, model(**row, use_cache=False).logits)
        deltanet.out_proj.weight.zero_()
        assert not torch.allclose(clone(**row, use_cache=False).logits, model(**row, use_cache=False).logits)


def test_fla_older_than_0_5_is_refused_by_auto_and_named_when_forced(fake_fla, monkeypatch):
    """fla <= 0.4.2 mis-computes grouped-value delta rules: auto must not pick it, a forced 'fla' names the fix."""
    from importlib import metadata

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.4.2" if name == "flash-linear-attention"
                        else real_version(name))
    monkeypatch.setattr(la.importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else None)
    la.fla_error.cache_clear()
    try:
        assert "0.4.2" in la.fla_error() and la.select_linear_backend("cuda") == "torch_segments"
        model = small_vocab_text_model()
        enable_packing(model)
        install_linear_attention_packing(model, DELTANET, backend="fla")
        _, row = text_batch([5, 9], seed=6)
        with torch.no_grad(), pytest.raises(ImportError, match=r"0\.4\.2.*>=0\.5\.0"):
            model(**row, use_cache=False)
    finally:
        la.fla_error.cache_clear()
