"""Gemma 4 packed exactly: causal, bidirectional image blocks on SLIDING layers only (inside the window), full
layers causal, never across samples.

Reference: each sample ALONE through the stock ``Gemma4ForConditionalGeneration`` with ``attn_implementation=
"sdpa"`` (transformers builds its masks from ``mm_token_type_ids``), loss = the model's own shifted CE. Packed: one
row (``pack_batch_sequences``) through ``enable_packing``. Tiny model: 4 text layers (sliding window 6, full,
sliding, full; the last two reuse the first two's K/V), key-equals-value full layers, per-layer inputs; a
5120-token vocabulary (media token ids lie above it: Gemma 4 embeds them as padding and scatters the vision
features in).

Substituted (no hub): token ids are synthetic (no Gemma 4 tokenizer offline); image tensors come from
transformers' own ``Gemma4ImageProcessor`` on ``skimage.data`` photos of different sizes (64, 55, 60 soft tokens).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from skimage import data

import vlm_pack.integrations.hf_model as hf
from vlm_pack import pack_batch_sequences
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import ImageBlockRule, UnsupportedModelError, get_family
from vlm_pack.testing.tiny_models import gemma4_image_processor, tiny_config

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, max_abs
BOI, EOI, IMAGE = 5001, 5002, 4124  # image begin/end are ordinary tokens to the model
VOCAB = 5120


def _model(implementation: str = "sdpa"):
    """The tiny Gemma 4 of ``tiny_config`` with a small vocabulary (same seed, same weights for every build)."""
    from transformers import Gemma4ForConditionalGeneration

    config = tiny_config("gemma4", layers=4)
    config.text_config.vocab_size = config.text_config.vocab_size_per_layer_input = VOCAB
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma4ForConditionalGeneration._from_config(config, attn_implementation=implementation,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def setup():
    stock = _model()
    packed = enable_packing(_model())
    photos = [data.astronaut(), data.coffee()[:200, :400], data.chelsea()]
    vision = gemma4_image_processor()([Image.fromarray(p) for p in photos], return_tensors="pt")
    soft = vision["num_soft_tokens_per_image"].tolist()
    generator = torch.Generator().manual_seed(0)

    def sample(images: list[int], tail: int = 7) -> dict:
        ids, types = [], []
        for piece in [None, *images]:
            if piece is not None:
                ids += [BOI] + [IMAGE] * soft[piece] + [EOI]
                types += [0] + [1] * soft[piece] + [0]
            ids += torch.randint(10, 4000, (4,), generator=generator).tolist()
            types += [0] * 4
        ids += torch.randint(10, 4000, (tail,), generator=generator).tolist()
        types += [0] * tail
        ids, types = torch.tensor(ids), torch.tensor(types)
        labels = ids.masked_fill(types != 0, -100)
        labels[: len(labels) // 2] = -100  # the "prompt" half carries no labels
        pixels = (vision["pixel_values"][images], vision["image_position_ids"][images]) if images else (None, None)
        return {"ids": ids, "types": types, "labels": labels, "pixels": pixels}

    samples = [sample([0]), sample([], tail=20), sample([1, 2]), sample([], tail=9)]
    width = max(len(s["ids"]) for s in samples)
    padded = {key: torch.full((len(samples), width), fill) for key, fill in (("ids", 0), ("types", 0), ("labels", -100))}
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        for key in padded:
            padded[key][row, : len(s["ids"])] = s[key]
        mask[row, : len(s["ids"])] = 1
    row = pack_batch_sequences(padded["ids"], labels=padded["labels"], padding_mask=mask)
    batch = {"input_ids": row.tokens, "position_ids": row.position_ids,
             "mm_token_type_ids": padded["types"][mask.bool()].unsqueeze(0),
             "pixel_values": vision["pixel_values"], "image_position_ids": vision["image_position_ids"],
             **row.attention_kwargs()}
    return stock, packed, samples, batch


def _alone(stock, s, grad=False):
    with torch.set_grad_enabled(grad):
        out = stock(input_ids=s["ids"][None], mm_token_type_ids=s["types"][None], pixel_values=s["pixels"][0],
                    image_position_ids=s["pixels"][1], labels=s["labels"][None], use_cache=False)
    return out.logits[0], out.loss


def _pieces(model, samples, batch, grad=False):
    with torch.set_grad_enabled(grad):
        logits = model(**batch, use_cache=False).logits[0]
    starts = batch["cu_seq_lens_q"].tolist()
    return [logits[start:start + len(s["ids"])] for start, s in zip(starts, samples)]


def _ce(logits, labels):
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)


@pytest.fixture(scope="module")
def reference(setup):
    stock, _, samples, _ = setup
    stock.zero_grad()
    runs = [_alone(stock, s, grad=True) for s in samples]
    sum(loss for _, loss in runs).backward()
    return [(logits.detach(), loss.detach()) for logits, loss in runs]


@pytest.fixture(scope="module")
def floor(setup, reference):
    """The stock reference's fp32 noise floors (logits, per-sample loss): each sample alone through an fp64 copy."""
    stock, _, samples, _ = setup
    stock64 = fp64_copy(stock)
    floors = SimpleNamespace(logits=NoiseFloor("logits"), loss=NoiseFloor("per-sample loss"))
    for s, (logits, loss) in zip(samples, reference):
        pixels = tuple(p.double() if p is not None and p.is_floating_point() else p for p in s["pixels"])
        logits64, loss64 = _alone(stock64, {**s, "pixels": pixels})
        floors.logits.observe(logits, logits64)
        floors.loss.observe(loss, loss64)
    return floors


def _errors(setup, reference):
    _, packed, samples, batch = setup
    return [float((got - ref).abs().max()) for got, (ref, _) in zip(_pieces(packed, samples, batch), reference)]


def test_packed_logits_losses_and_gradients_equal_each_sample_alone(setup, reference, floor):
    stock, packed, samples, batch = setup
    packed.zero_grad()
    pieces = _pieces(packed, samples, batch, grad=True)
    sum(_ce(got, s["labels"]) for got, s in zip(pieces, samples)).backward()
    for got, s, (ref, ref_loss) in zip(pieces, samples, reference):
        floor.logits.check(max_abs(got, ref))
        floor.loss.check(max_abs(_ce(got.detach(), s["labels"]), ref_loss))
    wanted = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    assert_grads_close({name: p.grad for name, p in packed.named_parameters() if name in wanted}, wanted)
    assert len(wanted) > 30


def test_corruption_image_blocks_made_causal_fails(setup, reference, floor, monkeypatch):
    monkeypatch.setattr(ImageBlockRule, "block_ids", lambda self, token_types, **_: torch.full_like(token_types, -1))
    errors = _errors(setup, reference)
    floor.logits.check(max(errors[1], errors[3]))  # text-only samples do not care
    assert min(errors[0], errors[2]) > 1e-2


def test_corruption_image_blocks_on_full_layers_too_fails(setup, reference, monkeypatch):
    """Gemma 4 keeps full layers causal: applying the blocks there (the Gemma 3 rule) must show."""
    monkeypatch.setattr(hf, "_layer_type", lambda module, sliding_window: "sliding_attention")
    errors = _errors(setup, reference)
    assert min(errors[0], errors[2]) > 1e-2


def test_corruption_sliding_window_dropped_fails(setup, reference, monkeypatch):
    original = hf.varlen_attention
    monkeypatch.setattr(hf, "varlen_attention", lambda *a, **k: original(*a, **{**k, "window": None}))
    assert min(_errors(setup, reference)) > 1e-2


def test_corruption_boundaries_dropped_fails(setup, reference, floor, boundaries_dropped):
    errors = _errors(setup, reference)
    floor.logits.check(errors[0])  # the first sample sees nothing before it
    assert min(errors[1:]) > 1e-2


def test_rule_follows_the_config():
    config = tiny_config("gemma4")
    spec = get_family(config)
    rule = spec.model.image_blocks(config)
    assert rule.layer_types == {"sliding_attention"} and rule.block_types == (1, 2)
    config.text_config.use_bidirectional_attention = None  # smaller Gemma 4: images causal, like transformers
    assert spec.model.image_blocks(config) is None


@pytest.mark.parametrize("change,match", [
    (lambda c: setattr(c.text_config, "use_bidirectional_attention", "all"), "use_bidirectional_attention='all'"),
    (lambda c: setattr(c.text_config, "enable_moe_block", True), "enable_moe_block"),
    (lambda c: setattr(c, "audio_config", {"model_type": "gemma4_audio"}), "audio tower"),
])
def test_unproven_gemma4_features_are_refused(change, match):
    config = tiny_config("gemma4")
    change(config)
    with pytest.raises(UnsupportedModelError, match=match):
        get_family(config)
