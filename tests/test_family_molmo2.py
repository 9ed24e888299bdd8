"""Molmo 2 (overlapping crops, pooled patches, one image block per sample) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/molmo2.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["molmo2"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


def test_molmo2_image_tokens_are_its_patches():
    """Molmo2Processor replaces its <|image|> placeholder whole (low-res and high-res views of <im_patch> rows framed by
    start / column / end markers): the family's image_token (<im_patch>, the model's image_patch_id) is what the
    collator counts, for its statistics and for splitting image_token_pooling (one row per patch token) per sample."""
    from vlm_pack.testing.data import photo_examples, text_chat_examples

    setup = families.setup_for("molmo2")
    examples = photo_examples(3, seed=2, max_side=84) + text_chat_examples(1, seed=2)
    batch = setup.collator(examples)
    patch = setup.processor.tokenizer.convert_tokens_to_ids("<im_patch>")
    assert patch == setup.packed.config.image_token_id
    assert not (batch["input_ids"] == setup.processor.image_token_id).any()
    tokens = int((batch["input_ids"] == patch).sum())
    assert batch["vlm_pack"]["stats"].image_tokens == tokens == batch["image_token_pooling"].shape[0] > 0
    assert batch["vlm_pack"]["stats"].images == batch["image_grids"].shape[0] > 3


def _crops_examples() -> list[dict]:
    """Molmo 2's own edges: images of different crop counts (a 14 px image: its low-res view and one crop; larger
    ones up to 4 crops), a sample whose two images are apart (text between them: two runs of image tokens, one
    block), a text-only sample between them."""
    from vlm_pack.testing.data import sample_photos, text_chat_examples

    photos = sample_photos(84)

    def image(name: str, size: tuple[int, int]) -> dict:
        return {"type": "image", "image": photos[name].resize(size)}

    return [
        {"messages": [{"role": "user", "content": [image("rocket", (14, 14)), {"type": "text", "text": "What?"}]},
                      {"role": "assistant", "content": "A rocket."}]},
        text_chat_examples(1, seed=5, max_turns=1)[0],
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "First"}, image("coffee", (84, 84)),
                                                    {"type": "text", "text": "then"}, image("chelsea", (56, 28)),
                                                    {"type": "text", "text": "Same?"}]},
                      {"role": "assistant", "content": "No: a cup, then a cat."}]},
    ]


def _chat(example: dict) -> list[dict]:
    """The example's turns as the stock processor's apply_chat_template takes them (images decoded)."""
    from vlm_pack.data.chat import normalize_example

    return normalize_example(example, 0)


def _runs(token_types: torch.Tensor) -> int:
    """Runs of image tokens (mm_token_type_ids == 1) in a row."""
    inside = torch.nn.functional.pad((token_types.reshape(-1) == 1).long(), (1, 0))
    return int((inside.diff() == 1).sum())


@pytest.fixture(scope="module")
def crops():
    """The crop-count batch, its per-sample references and the packed batch (shared by the tests below)."""
    setup = families.setup_for("molmo2")
    examples = _crops_examples()
    with torch.no_grad():
        refs = families.references(setup, examples)
    return setup, examples, refs, setup.collator(examples)


def test_molmo2_crop_counts_and_separate_images_equal_each_sample_alone(crops):
    """Images of 2, 5 and 4 crops, two images apart in one sample (two image-token runs), text-only between: packed ==
    each sample alone (logits, losses, the model's own loss, gradients)."""
    setup, examples, _, batch = crops
    assert batch["image_num_crops"].tolist() == [2, 5, 4]  # crops of each image: 1 + its tiling
    segments = batch["vlm_pack"]["cu_seqlens"].tolist()
    assert _runs(batch["mm_token_type_ids"][:, segments[2]:segments[3]]) == 2
    result = families.compare(setup, examples)
    families.MEASURED.setdefault("molmo2", {}).update({f"crops_{k}": v for k, v in result.items()})
    print("molmo2 crops", result)
    families.assert_exact(result)


@torch.no_grad()
def test_corruption_molmo2_pooling_not_rebased(crops):
    """image_token_pooling numbers the flattened patches of the whole processor call: the collator gives each
    sample its own indices and re-bases them by the patches of the samples before it. The samples' own indices
    concatenated unchanged (not re-based: the third sample's tokens pool the first sample's patches) are caught."""
    setup, examples, refs, batch = crops
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))
    samples = setup.collator._encode_all(examples)[0]
    own = torch.cat([s["image_token_pooling"] for s in samples if "image_token_pooling" in s])
    assert own.shape == batch["image_token_pooling"].shape and not torch.equal(own, batch["image_token_pooling"])
    error = families.logit_error(batch, families.packed_logits(setup.packed, batch, image_token_pooling=own), refs)
    print("molmo2 pooling not re-based", error, refs[3].logits.tolerance)
    assert refs[3].logits.is_far(error)


def _with_block_ids(monkeypatch, ids_of):
    """ImageBlockRule.block_ids replaced by ``ids_of(rule, token_types, cu_seqlens)``."""
    from vlm_pack.models import ImageBlockRule

    monkeypatch.setattr(ImageBlockRule, "block_ids",
                        lambda self, token_types, cu_seqlens=None: ids_of(self, token_types, cu_seqlens))


@torch.no_grad()
def test_corruption_molmo2_image_blocks_per_run_or_causal(crops, monkeypatch):
    """Molmo 2 makes ALL image tokens of a sequence one bidirectional block (block id 0 over every image), which the
    family's ImageBlockRule(scope="sample") gives each packed sample. Caught: each contiguous run its own block (the
    Gemma 3 rule: the two images of the third sample then stop seeing each other), and images left causal."""
    from vlm_pack.models import ImageBlockRule

    setup, _, refs, batch = crops
    run_ids = ImageBlockRule.block_ids

    for name, ids_of in (("per run", lambda rule, types, cu: run_ids(dataclasses.replace(rule, scope="run"), types)),
                         ("causal", lambda rule, types, cu: torch.full_like(types, -1))):
        _with_block_ids(monkeypatch, ids_of)
        error = families.logit_error(batch, families.packed_logits(setup.packed, batch), refs)
        print("molmo2 image blocks", name, error, refs[3].logits.tolerance)
        assert refs[3].logits.is_far(error)


@torch.no_grad()
def test_molmo2_one_block_never_crosses_samples(crops, monkeypatch):
    """The block is per sample. Measured with the STOCK sdpa model on the packed row and explicit 4-D masks: the
    rule's mask (same sample AND (causal OR both image tokens)) is exact, the one block across samples (image tokens
    of different samples seeing each other) is caught. The packing attention cannot express the latter: block ids
    shared by every sample of the row (transformers' own block id 0) are still cut at the sample boundaries."""
    setup, _, refs, batch = crops
    segments = torch.repeat_interleave(torch.arange(batch["vlm_pack"]["seq_lengths"].numel()),
                                       batch["vlm_pack"]["seq_lengths"])
    image = batch["mm_token_type_ids"][0] == 1
    order = torch.arange(segments.numel())
    same = segments[:, None] == segments[None, :]
    causal = order[:, None] >= order[None, :]
    both = image[:, None] & image[None, :]
    stock = dict.fromkeys(families.BOUNDARY_KWARGS)
    for mask, exact in (((same & (causal | both)), True), ((same & causal) | both, False)):
        logits = families.packed_logits(setup.stock, batch, **stock, attention_mask=mask[None, None])
        error = families.logit_error(batch, logits, refs)
        print("molmo2 stock 4-D mask", "rule" if exact else "across samples", error, refs[3].logits.tolerance)
        if exact:
            refs[3].logits.check(error)
        else:
            assert refs[3].logits.is_far(error), error

    _with_block_ids(monkeypatch, lambda rule, types, cu: torch.where(types == 1, 0, -1))
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))


def test_molmo2_tokens_are_the_processors_and_labels_its_answers():
    """Molmo2Processor puts its BOS (here the tokenizer's EOS: it has no BOS) before every prompt AFTER
    apply_chat_template recorded the assistant spans, so its own assistant mask is shifted by that token: the
    family has the template write it. The collator's tokens equal the stock processor's, and its labels are exactly
    the answers (+ <|im_end|>); the stock mask (the corruption) labels the turn's header instead."""
    setup = families.setup_for("molmo2")
    processor, tokenizer = setup.processor, setup.processor.tokenizer
    example = _crops_examples()[0]
    stock = processor.apply_chat_template([_chat(example)], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
    sample = setup.collator._encode_all([example])[0][0]
    assert sample["input_ids"][0].tolist() == stock["input_ids"][0]
    assert sample["input_ids"][0, 0] == tokenizer.eos_token_id
    labels = sample["labels"][0]
    assert tokenizer.decode(labels[labels != -100]) == "A rocket.<|im_end|>"
    shifted = torch.tensor(stock["input_ids"][0])[torch.tensor(stock["assistant_masks"][0]).bool()]
    assert tokenizer.decode(shifted) != "A rocket.<|im_end|>"


def test_molmo2_video_and_missing_token_types_are_refused():
    """Videos are not proven for Molmo 2: refused by name when the batch is built. A forward with pixel_values but
    without mm_token_type_ids (which the model also requires in training) is refused: its images would stay causal."""
    import numpy as np

    setup = families.setup_for("molmo2")
    video = {"messages": [{"role": "user", "content": [{"type": "video", "video": np.zeros((2, 28, 28, 3), np.uint8)}]},
                          {"role": "assistant", "content": "Nothing."}]}
    with pytest.raises(ValueError, match="a video with a molmo2 model: video inputs .* is not proven for this family"):
        setup.collator([video])
    batch = setup.collator(_crops_examples()[:1])
    with pytest.raises(ValueError, match="got pixel_values without mm_token_type_ids"):
        families.packed_logits(setup.packed, batch, mm_token_type_ids=None)


def test_molmo2_bos_is_written_once():
    """A template that already writes the BOS (as the allenai templates will) is left as it is: the processor then
    adds none, and the collator's tokens are still the stock processor's, with one BOS."""
    from vlm_pack.data.collator import VLMPackingCollator

    setup = families.setup_for("molmo2")
    processor, tokenizer = setup.processor, setup.processor.tokenizer
    template = "{{ eos_token }}" + processor.chat_template
    collator = VLMPackingCollator(processor, max_length=2048, model_config=setup.packed.config, chat_template=template)
    assert collator.chat.template == template
    example = _crops_examples()[0]
    stock = processor.apply_chat_template([_chat(example)], chat_template=template, tokenize=True, return_dict=True)
    ids = collator._encode_all([example])[0][0]["input_ids"][0]
    assert ids.tolist() == stock["input_ids"][0] and ids[0] == tokenizer.eos_token_id != ids[1]  # one BOS


def test_patch_indices_outside_their_sample_are_refused():
    """Patch indices a sample's share cannot own (pointing before its first patch or past its last) are refused,
    naming the sample: they could not follow it into a packed row."""
    from vlm_pack.data import patch_index

    pixels = [torch.zeros(2, 4, 1), None, torch.zeros(1, 4, 1)]  # 8 patches, none, 4 patches
    indices = [torch.tensor([[0, 7, -1]]), None, torch.tensor([[8, 11, -1]])]
    local = patch_index.localize(indices, pixels, "image_token_pooling", "pixel_values")
    assert local[2].tolist() == [[0, 3, -1]]
    assert patch_index.join(local, pixels).tolist() == [[0, 7, -1], [8, 11, -1]]
    with pytest.raises(ValueError, match="sample 2: processor output 'image_token_pooling' indexes patches outside"):
        patch_index.localize([indices[0], None, torch.tensor([[7, 8, -1]])], pixels, "image_token_pooling",
                             "pixel_values")
