"""The core proof: training on a packed batch equals training on its samples one by one.

For tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL (fp32, CPU, real photos of several sizes, 1-3 images per
sample) and a tiny Llama on text, the packed row's per-token losses equal each sample run ALONE through the
STOCK Hugging Face model with the same weights (``attn_implementation="sdpa"``: none of our attention code; no
padding, positions computed by the model itself; loss a plain shifted cross entropy), position by position
within the measured fp32 noise (``tests/tolerance.py``), and the parameter gradients match (1e-4 relative L2). A test below shows why the reference must be the
stock model: an error in our attention that a lone sample also sees is invisible against our own model.

Two routes read packed boundaries, and the collator's batch must be exact on both:
* "kwargs": ``cu_seq_lens_q/k`` forward kwargs into the ``vlm_pack_varlen`` attention (our main route);
* "positions": no ``cu_seq_lens``: boundaries come from the TEXT row of ``position_ids`` (HF's own packed
  detection under sdpa, and the ``vlm_pack_varlen`` fallback). A dropped text row, positions computed over the
  whole row, or an ``attention_mask`` in the batch all break this route: the corruption tests prove each one
  changes the loss beyond the tolerance. (On the "kwargs" route, whole-row positions are invisible: RoPE only
  sees position differences within a segment. That is why both routes are checked.)
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator, model_inputs
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION, enable_packing
from vlm_pack.core.loss import packed_cross_entropy
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_model

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, fp64_inputs
BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


def vlm_examples(n: int, seed: int) -> list[dict]:
    """Photos (1-3 per sample, several sizes), an easy-vqa sample and a text-only turn, mixed."""
    examples = photo_examples(max(1, n - 2), seed=seed, max_side=84) + easy_vqa_examples(1, seed=seed)
    if n >= 3:
        examples.insert(1, text_chat_examples(1, seed=seed)[0])
    return examples[:n]


def packed_losses(model, batch: dict, route: str = "kwargs", **overrides) -> torch.Tensor:
    """Per-slot losses ``[T]`` of the packed row (targets shifted inside each sample)."""
    inputs = model_inputs(batch)
    if route == "positions":
        inputs = {k: v for k, v in inputs.items() if k not in BOUNDARY_KWARGS}
    inputs.update(overrides)
    logits = model(**inputs, use_cache=False).logits
    return packed_cross_entropy(logits, batch["labels"], batch["cu_seq_lens_q"], reduction="none")[0]


def stock_sdpa(model, family: str):
    """The reference model: the same weights in the stock HF class with ``attn_implementation="sdpa"``."""
    stock = tiny_model(family, attn_implementation="sdpa")
    stock.load_state_dict(model.state_dict())
    text_config = getattr(stock.config, "text_config", stock.config)
    assert text_config._attn_implementation == "sdpa"
    return stock


def reference_losses(model, collator: VLMPackingCollator, examples: list[dict]
                     ) -> tuple[list[torch.Tensor], NoiseFloor]:
    """Each sample alone through ``model`` (the stock sdpa twin), unpadded, positions left to the model, loss the
    plain HF shifted cross entropy: per-token losses ``[L_i]`` (last slot 0), and their fp32 noise floor (the same
    samples through an fp64 copy of ``model``)."""
    alone = VLMPackingCollator(
        collator.processor, max_length=collator.max_length, pack_sequences_in_batch=False, model_config=model.config
    )
    model64, floor = fp64_copy(model), NoiseFloor("per-token loss")
    out = []
    for example in examples:
        single = alone([example])
        inputs = {k: v for k, v in model_inputs(single).items() if k != "attention_mask"}
        labels = single["labels"][0]
        losses = shifted_losses(model(**inputs, use_cache=False).logits[0], labels)
        with torch.no_grad():
            floor.observe(losses, shifted_losses(model64(**fp64_inputs(inputs), use_cache=False).logits[0], labels))
        out.append(torch.cat([losses, losses.new_zeros(1)]))
    return out, floor


def shifted_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")


def per_sample_view(losses: torch.Tensor, batch: dict) -> list[torch.Tensor]:
    """Split packed per-slot losses into each sample's real slots; alignment slots must carry no loss."""
    starts = batch["vlm_pack"]["cu_seqlens_padded"][:-1].tolist()
    lengths = batch["vlm_pack"]["seq_lengths"].tolist()
    real = torch.zeros_like(losses, dtype=torch.bool)
    for start, length in zip(starts, lengths):
        real[start : start + length] = True
    assert torch.all(losses[~real] == 0), "alignment slots must not contribute to the loss"
    return [losses[start : start + length] for start, length in zip(starts, lengths)]


def max_loss_diff(packed: torch.Tensor, batch: dict, reference: list[torch.Tensor]) -> float:
    return max((p - r).abs().max().item() for p, r in zip(per_sample_view(packed, batch), reference))


def assert_exact(model, stock, collator: VLMPackingCollator, examples: list[dict], routes=("kwargs",)) -> None:
    """Per-token losses equal the per-sample reference of the ``stock`` sdpa model on every route; gradients
    equal on the first."""
    batch = collator(examples)
    assert "attention_mask" not in batch
    n_tokens = int((batch["labels"] != -100).sum())
    assert n_tokens > 0

    stock.zero_grad()
    reference, floor = reference_losses(stock, collator, examples)
    torch.stack([r.sum() for r in reference]).sum().div(n_tokens).backward()
    ref_grads = {name: p.grad.clone() for name, p in stock.named_parameters() if p.grad is not None}

    for i, route in enumerate(routes):
        model.zero_grad()
        packed = packed_losses(model, batch, route)
        diff = max_loss_diff(packed.detach(), batch, [r.detach() for r in reference])
        floor.check(diff, f"route {route}")
        if i == 0:
            packed.sum().div(n_tokens).backward()
            assert_grads_close({name: p.grad for name, p in model.named_parameters() if p.grad is not None}, ref_grads)


def exact_setup(model, processor, stock, seed: int = 5):
    """Collator, packed batch of 3 VLM samples, their per-sample reference losses (``stock`` sdpa model) and the
    losses' fp32 noise floor, after asserting that the clean batch is exact on the "positions" route (so a corruption test's difference comes
    from its change)."""
    collator = VLMPackingCollator(processor, max_length=1024, model_config=model.config)
    examples = vlm_examples(3, seed=seed)
    batch = collator(examples)
    with torch.no_grad():
        reference, floor = reference_losses(stock, collator, examples)
        floor.check(max_loss_diff(packed_losses(model, batch, "positions"), batch, reference))
    return collator, batch, reference, floor


# Every family at two micro-batch sizes; together they cover 2..6.
@pytest.mark.parametrize(
    ("family", "micro_batch"),
    [("qwen2_vl", 2), ("qwen2_vl", 6), ("qwen2_5_vl", 3), ("qwen2_5_vl", 5), ("qwen3_vl", 2), ("qwen3_vl", 4)],
)
def test_packed_vlm_equals_per_sample(processor, family, micro_batch):
    model = enable_packing(tiny_model(family))
    collator = VLMPackingCollator(processor, max_length=1024, model_config=model.config)
    examples = vlm_examples(micro_batch, seed=micro_batch)
    assert sum(len(m["content"]) for e in examples for m in e["messages"] if isinstance(m["content"], list)) > 0
    assert_exact(model, stock_sdpa(model, family), collator, examples, routes=("kwargs", "positions"))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_packed_vlm_with_context_parallel_alignment(processor, family):
    """cp=2 pads every sample to a multiple of 4: alignment slots must change nothing."""
    model = enable_packing(tiny_model(family))
    collator = VLMPackingCollator(processor, max_length=1024, model_config=model.config, context_parallel_size=2)
    examples = vlm_examples(4, seed=7)
    batch = collator(examples)
    assert torch.all(batch["vlm_pack"]["cu_seqlens_padded"] % 4 == 0)
    assert batch["vlm_pack"]["stats"].padded_slots > 0
    assert_exact(model, stock_sdpa(model, family), collator, examples, routes=("kwargs", "positions"))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_hf_sdpa_route_reads_boundaries_from_text_row(processor, family):
    """Plain transformers (sdpa, no cu_seq_lens): the 4-row position ids alone keep samples apart."""
    model = tiny_model(family, attn_implementation="sdpa")
    exact_setup(model, processor, model, seed=3)  # asserts the "positions" route is exact


def test_padded_mode_equals_per_sample(processor):
    """The A/B baseline: the same samples right-padded, with an attention_mask, are exact too."""
    model = tiny_model("qwen2_vl", attn_implementation="sdpa")
    kwargs = dict(max_length=1024, model_config=model.config)
    padded = VLMPackingCollator(processor, pack_sequences_in_batch=False, **kwargs)
    examples = vlm_examples(4, seed=11)
    batch = padded(examples)
    with torch.no_grad():
        logits = model(**model_inputs(batch), use_cache=False).logits
        reference, floor = reference_losses(model, padded, examples)
    for row, ref in enumerate(reference):
        labels = batch["labels"][row]
        losses = torch.nn.functional.cross_entropy(logits[row, :-1], labels[1:], reduction="none")
        length = ref.numel()
        floor.check((losses[: length - 1] - ref[:-1]).abs().max().item(), f"row {row}")
        assert torch.all(losses[length - 1 :] == 0)


# ------------------------------------------------------------------ corruptions must be caught


@pytest.fixture(scope="module")
def qwen2_setup(processor):
    model = enable_packing(tiny_model("qwen2_vl"))
    return (model, *exact_setup(model, processor, stock_sdpa(model, "qwen2_vl")))


def test_dropping_text_row_of_position_ids_is_caught(qwen2_setup):
    model, _, batch, reference, floor = qwen2_setup
    three_rows = batch["position_ids"][1:]
    with torch.no_grad():
        losses = packed_losses(model, batch, "positions", position_ids=three_rows)
    assert floor.is_far(max_loss_diff(losses, batch, reference))


def test_positions_over_whole_packed_row_are_caught(qwen2_setup):
    model, collator, batch, reference, floor = qwen2_setup
    row = batch["input_ids"]
    whole_row = collator.rope_index(
        row, batch["mm_token_type_ids"], torch.ones_like(row), image_grid_thw=batch["image_grid_thw"]
    )
    assert not torch.equal(whole_row, batch["position_ids"])
    with torch.no_grad():
        losses = packed_losses(model, batch, "positions", position_ids=whole_row)
    assert floor.is_far(max_loss_diff(losses, batch, reference))


def test_attention_mask_on_packed_row_is_caught(processor):
    """HF's own packed detection is off as soon as an attention_mask is given: samples attend to each other."""
    model = tiny_model("qwen2_vl", attn_implementation="sdpa")
    _, batch, reference, floor = exact_setup(model, processor, model)
    with torch.no_grad():
        masked = packed_losses(model, batch, "positions", attention_mask=torch.ones_like(batch["input_ids"]))
    assert floor.is_far(max_loss_diff(masked, batch, reference))


# ------------------------------------------------------------------ text-only LLM


@pytest.fixture(scope="module")
def llama_setup(tokenizer):
    model = enable_packing(tiny_model("llama"))
    collator = VLMPackingCollator(tokenizer, max_length=1024)
    return model, collator, stock_sdpa(model, "llama")


@pytest.mark.parametrize("micro_batch", [2, 5])
def test_packed_llama_equals_per_sample(llama_setup, micro_batch):
    model, collator, stock = llama_setup
    examples = text_chat_examples(micro_batch, seed=micro_batch)
    batch = collator(examples)
    assert batch["position_ids"].shape == batch["input_ids"].shape
    assert_exact(model, stock, collator, examples, routes=("kwargs", "positions"))


def test_llama_corruptions_are_caught(llama_setup):
    model, collator, stock = llama_setup
    examples = text_chat_examples(4, seed=1)
    batch = collator(examples)
    with torch.no_grad():
        reference, floor = reference_losses(stock, collator, examples)
        whole_row = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
        wrong_positions = packed_losses(model, batch, "positions", position_ids=whole_row)
        sdpa = tiny_model("llama", attn_implementation="sdpa")
        masked = packed_losses(sdpa, batch, "positions", attention_mask=torch.ones_like(batch["input_ids"]))
        floor.check(max_loss_diff(packed_losses(sdpa, batch, "positions"), batch, reference))
    assert floor.is_far(max_loss_diff(wrong_positions, batch, reference))
    assert floor.is_far(max_loss_diff(masked, batch, reference))


def test_model_is_really_on_packing_attention():
    model = enable_packing(tiny_model("qwen2_vl"))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert model.config.text_config._attn_implementation == ATTN_IMPLEMENTATION


def test_reference_is_independent_of_our_attention(llama_setup, monkeypatch):
    """Corrupt our attention in a way a lone sample sees too (softmax scale x 1.25): against our own model run
    per sample the packed losses would still agree; against the stock sdpa reference they do not."""
    import vlm_pack.integrations.hf_model as hf

    model, collator, stock = llama_setup
    examples = text_chat_examples(3, seed=2)
    batch = collator(examples)
    def wrong_scale(real):
        def attend(q, *args, softmax_scale=None, **kwargs):
            scale = (q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale) * 1.25
            return real(q, *args, softmax_scale=scale, **kwargs)
        return attend

    for kernel in ("varlen_attention", "dense_attention"):  # packed rows, and a lone unpacked sample
        monkeypatch.setattr(hf, kernel, wrong_scale(getattr(hf, kernel)))
    with torch.no_grad():
        packed = packed_losses(model, batch)
        against_ourselves, _ = reference_losses(model, collator, examples)
        against_stock, floor = reference_losses(stock, collator, examples)
    floor.check(max_loss_diff(packed, batch, against_ourselves))  # the shared error is invisible ...
    assert floor.is_far(max_loss_diff(packed, batch, against_stock))  # ... the stock model exposes it
