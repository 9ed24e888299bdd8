"""Round-3 families (issue 39, part C) exact under packing: the composite Gemma 3n (timm MobileNetV5 tower),
PaliGemma (prefix-LM), FastVLM (BatchNorm tower), PerceptionLM (tile stacks).

The proof of tests/test_families_round3a.py (the harness of tests/test_vlm_families.py: each sample run ALONE
through the stock sdpa model, fp32 CPU, the edge batch, a corruption per family rule, token-budget plans equal to the
processor's lengths). Tiny models and offline processors: ``vlm_pack.testing.tiny_families`` (the builders of
``tiny_families_round3c``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family
from vlm_pack.testing.tiny_families import tiny_vlm

import test_vlm_families as families
from test_budget_packs import _GROUPS, assert_planned_lengths_are_the_processors
from test_vlm_families import (
    assert_exact, assert_packed_exact, edge_examples, errors, exact_batch, logit_error, packed_logits, references,
    setup_for, swap_examples,
)
from version_gates import refused

pytest.importorskip("timm")  # the Gemma 3n, PerceptionLM and FastVLM towers (the package's `test` extra installs it)
pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["gemma3n", "fast_vlm", "perception_lm"]


@pytest.mark.parametrize("family", FAMILIES)
def test_edge_batch_equals_each_sample_alone(family):
    """Edge batch packed against each sample alone: logits, per-sample losses, the model's own loss, gradients."""
    assert_packed_exact(setup_for(family), edge_examples())


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_rows_given_to_the_wrong_sample_are_caught(family):
    """Two same-size single-image samples' vision rows swapped (a well-formed batch) break the comparison; positions
    not restarted per sample are caught (the stock sdpa model reading boundaries from restarting position ids, as
    HF does without cu_seq_lens, is exact; with whole-row positions it is not)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_length_equals_the_real_processor(family):
    """Token-budget plans count what the processor writes, for images of many sizes and several per sample."""
    assert_planned_lengths_are_the_processors(setup_for(family).collator)


# ------------------------------------------------------------------ Gemma 3n (composite)


@torch.no_grad()
def test_gemma3n_sliding_window_and_audio_refusal(monkeypatch):
    """The sliding layers keep their window inside each sample (a dropped window is caught); audio inputs in a
    packed row are refused by name; the composite config with another language model is refused."""
    setup = setup_for("gemma3n")
    examples = edge_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    plain = hf_model.varlen_attention
    monkeypatch.setattr(hf_model, "varlen_attention", lambda *a, **k: plain(*a, **{**k, "window": None}))
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="Gemma 3n audio inputs"):
        packed_logits(setup.packed, batch, input_features=torch.zeros(1, 8, 128),
                      input_features_mask=torch.ones(1, 8, dtype=torch.bool))
    config = copy.deepcopy(setup.packed.config)  # (timm writes layer factories into the tiny tower's model_args)
    config.text_config.layer_types = ["chunked_attention"] * len(config.text_config.layer_types)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        get_family(config)


# ------------------------------------------------------------------ PaliGemma (prefix-LM)


def _paligemma_examples(seed: int = 3) -> list[dict]:
    """Single-turn photo Q&A (PaliGemma's format): 1-3 images of different sizes per sample."""
    from vlm_pack.testing.data import photo_examples

    return photo_examples(4, seed=seed, max_side=56)


def test_paligemma_packed_equals_each_sample_alone():
    """Logits, per-sample losses (the processor's own suffix labels), the model's own loss and gradients of a
    packed micro-batch vs each sample alone through the stock model (its own prefix-LM mask and 1-indexed
    positions); multi-image samples of different sizes."""
    setup = setup_for("paligemma")
    examples = _paligemma_examples()
    assert max(sum(p["type"] == "image" for p in e["messages"][0]["content"]) for e in examples) > 1
    assert_packed_exact(setup, examples, "photos")


@torch.no_grad()
def test_paligemma_prefix_block_and_causal_answer_are_each_needed(monkeypatch):
    """The prefix-LM rule has two halves, each caught: the text layers left non-causal (as PaliGemmaConfig sets
    them: the answer would attend both ways) and the prefix made causal (no prefix block)."""
    from vlm_pack.models import paligemma

    setup = setup_for("paligemma")
    batch, refs = exact_batch(setup, _paligemma_examples())
    no_prefix = packed_logits(setup.packed, batch, token_type_ids=torch.ones_like(batch["token_type_ids"]))
    assert refs[3].logits.is_far(logit_error(batch, no_prefix, refs))
    layers = [m for m in setup.packed.model.language_model.modules() if hasattr(m, "is_causal")
              and hasattr(m, "q_proj")]
    assert layers and all(layer.is_causal for layer in layers)
    for layer in layers:
        monkeypatch.setattr(layer, "is_causal", False)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))
    assert paligemma.PREFIX_BLOCKS.block_types == (0,)


def test_paligemma_planned_length_equals_the_real_processor():
    """Token-budget plans count what the processor's prompt / suffix encoding writes, for images of many sizes and
    several per sample."""
    planned = assert_planned_lengths_are_the_processors(setup_for("paligemma").collator)
    assert planned.image_tokens.tolist() == [4 * len(group) for group in _GROUPS]


def test_paligemma_refusals():
    """A language model other than Gemma / Gemma 2 (PaliGemma 2: tests/test_families_round3f.py) is refused by name;
    so are samples PaliGemma's single-turn format cannot hold (a system turn, two turns, no image, an image in the
    answer) and a chat template."""
    from transformers import PaliGemmaConfig

    from vlm_pack.testing.data import text_chat_examples

    with refused(UnsupportedModelError, r"language model 'gemma3_text' \(proven language models for ",
                 family="paligemma"):
        get_family(PaliGemmaConfig(text_config={"model_type": "gemma3_text"}))
    setup = setup_for("paligemma")
    photo = _paligemma_examples()[0]
    system = {"messages": [{"role": "system", "content": "Be brief."}, *photo["messages"]]}
    twice = {"messages": photo["messages"] * 2}
    in_answer = {"messages": [photo["messages"][0], {"role": "assistant", "content": photo["messages"][0]["content"]}]}
    for example, message in ((system, r"sample 0: PaliGemma is a single-turn prefix-LM.*\['system', 'user'"),
                             (twice, r"single-turn.*\['user', 'assistant', 'user', 'assistant'\]"),
                             (text_chat_examples(1, seed=1, max_turns=1)[0], "at least one image"),
                             (in_answer, "images in the user turn only")):
        with pytest.raises(ValueError, match=message):
            setup.collator([example])
    with pytest.raises(ValueError, match="not by a chat template"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, chat_template="{{ x }}")
    with pytest.raises(ValueError, match="prefix blocks|image blocks"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, context_parallel_size=2)


# ------------------------------------------------------------------ FastVLM (BatchNorm tower)


@torch.no_grad()
def test_fast_vlm_training_batch_norm_is_refused_and_freeze_batch_norm_is_exact():
    """A packed row through the tower with its BatchNorm layers in training mode is refused by name (they would mix
    the samples' images: measured far from each sample alone); after freeze_batch_norm, model.train() keeps them on
    their running statistics and the packed row is exact again."""
    from vlm_pack.models.fast_vlm import freeze_batch_norm

    setup = setup_for("fast_vlm")
    examples = swap_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    model = enable_packing(tiny_vlm("fast_vlm", setup.processor)).train()
    with pytest.raises(ValueError, match="BatchNorm layers in training mode"):
        packed_logits(model, batch)
    mixed = packed_logits(setup.stock.train(), batch)  # what the refused row would compute (stock, batch stats)
    setup.stock.eval()
    assert refs[3].logits.is_far(logit_error(batch, mixed, refs))
    freeze_batch_norm(model).train()
    assert_exact(errors(batch, packed_logits(model, batch), refs))


# ------------------------------------------------------------------ PerceptionLM (tile stacks)


@torch.no_grad()
def test_perception_lm_tile_stacks_of_different_lengths_are_flattened_per_tile():
    """The processor cannot batch images whose tile counts differ (its own stack fails); the collator flattens each
    image's tiles to rows (the edge batch holds images of different tile counts): exact, and the tile rows handed
    over in reverse order are caught."""
    from PIL import Image

    setup = setup_for("perception_lm")
    images = [[Image.new("RGB", (64, 32))], [Image.new("RGB", (32, 32))]]
    with pytest.raises(Exception, match="stack expects each tensor to be equal size|equal size"):
        setup.processor(images=images, text=["<|image|> a", "<|image|> b"], return_tensors="pt")
    examples = edge_examples()
    batch, refs = exact_batch(setup, examples)
    tokens = int((batch["input_ids"] == setup.processor.image_token_id).sum())
    assert batch["pixel_values"].shape[1] == 1 and batch["pixel_values"].shape[0] * 4 == tokens
    pictures = [p["image"] for e in examples for m in e["messages"] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image"]
    tiles = [len(setup.processor.image_processor(p, return_tensors=None)["pixel_values"][0]) for p in pictures]
    assert len(set(tiles)) > 1 and sum(tiles) == batch["pixel_values"].shape[0], tiles
    reordered = batch["pixel_values"].flip(0)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch, pixel_values=reordered), refs))
