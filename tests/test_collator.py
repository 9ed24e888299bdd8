"""VLMPackingCollator: layout of the packed row, labels, positions, vision tensors, stats, workers, inputs."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from vlm_pack.data.collator import CollatorStats, VLMPackingCollator, model_inputs
from vlm_pack.core.config import PackingConfig
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, sample_photos, text_chat_examples
from vlm_pack.testing.tiny_models import qwen_tokenizer, qwen_tokenizer_path, tiny_model

IGNORE = -100


# ``processor``, ``qwen2_config`` and ``collator`` come from conftest.py.


@pytest.fixture(scope="module")
def examples():
    return photo_examples(3, seed=1, max_side=84) + easy_vqa_examples(2, seed=1) + text_chat_examples(1, seed=1)


def singles(processor, config, examples) -> list[dict]:
    """Each example collated alone, unpadded (padded mode with one sample)."""
    alone = VLMPackingCollator(processor, max_length=512, model_config=config, pack_sequences_in_batch=False)
    return [alone([example]) for example in examples]


def test_packed_row_concatenates_samples_in_order(processor, qwen2_config, collator, examples):
    batch = collator(examples)
    alone = singles(processor, qwen2_config, examples)
    lengths = [s["input_ids"].shape[1] for s in alone]
    cu = np.concatenate([[0], np.cumsum(lengths)])

    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == (1, cu[-1])
    assert batch["vlm_pack"]["cu_seqlens"].tolist() == cu.tolist()
    assert batch["vlm_pack"]["cu_seqlens_padded"].tolist() == cu.tolist()  # cp = tp = 1: no alignment
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32 and torch.equal(batch[key], batch["vlm_pack"]["cu_seqlens_padded"])
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths)
    assert batch["vlm_pack"]["seq_lengths"].tolist() == lengths
    for i, single in enumerate(alone):
        for key in ("input_ids", "labels", "mm_token_type_ids"):
            assert torch.equal(batch[key][0, cu[i] : cu[i + 1]], single[key][0]), (key, i)
    with_images = [s for s in alone if "pixel_values" in s]
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in with_images]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in with_images]))


def test_mrope_positions_are_per_sample_and_match_the_model(processor, qwen2_config, collator, examples):
    """Row 0: 0..L-1 per sample. Rows 1-3: exactly what the model's own get_rope_index gives each sample alone."""
    model = tiny_model("qwen2_vl")
    batch = collator(examples)
    positions = batch["position_ids"]
    assert positions.shape == (4, 1, batch["input_ids"].shape[1])
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    for i, single in enumerate(singles(processor, qwen2_config, examples)):
        segment = positions[:, 0, cu[i] : cu[i + 1]]
        assert torch.equal(segment[0], torch.arange(cu[i + 1] - cu[i]))
        expected, _ = model.model.get_rope_index(
            single["input_ids"],
            mm_token_type_ids=single["mm_token_type_ids"],
            image_grid_thw=single.get("image_grid_thw"),
        )
        assert torch.equal(segment[1:], expected[:, 0]), i


def test_labels_only_on_assistant_turns(processor, collator):
    tokenizer = processor.tokenizer
    example = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "image", "image": sample_photos(56)["chelsea"]},
                                         {"type": "text", "text": "What animal?"}]},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "Which color?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Brown and grey."}]},
        ]
    }
    batch = collator([example, text_chat_examples(1)[0]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    first = slice(0, batch["vlm_pack"]["cu_seqlens"][1].item())
    labelled = labels[first] != IGNORE
    assert torch.equal(labels[first][labelled], ids[first][labelled])  # aligned, unshifted
    # Contiguous labelled runs are exactly the two assistant answers, each closed by "<|im_end|>\n" (what TRL's
    # training variant of the official Qwen2-VL template puts in its generation blocks).
    runs, current = [], []
    for token, keep in zip(ids[first].tolist() + [-1], labelled.tolist() + [False]):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    assert runs == ["A cat.<|im_end|>\n", "Brown and grey.<|im_end|>\n"]
    assert not labelled[ids[first] == processor.image_token_id].any()


def test_alignment_for_context_and_sequence_parallel(processor, qwen2_config, examples):
    """cp=2, tp=2, sp -> pad_multiple = 4: every sequence aligned; fill slots are inert and keep counting."""
    collator = VLMPackingCollator(
        processor, max_length=512, model_config=qwen2_config,
        context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
    )
    assert collator.pad_to_multiple_of == 4
    batch = collator(examples)
    cu_padded = batch["vlm_pack"]["cu_seqlens_padded"]
    assert torch.all(cu_padded.diff() % 4 == 0)
    assert torch.equal(batch["cu_seq_lens_q"], cu_padded)
    assert batch["max_length_q"] == int(cu_padded.diff().max())
    fill = torch.ones_like(batch["input_ids"][0], dtype=torch.bool)
    for start, length in zip(cu_padded[:-1].tolist(), batch["vlm_pack"]["seq_lengths"].tolist()):
        fill[start : start + length] = False
        end = int(cu_padded[cu_padded.tolist().index(start) + 1])
        # text positions keep counting through the alignment slots
        assert batch["position_ids"][0, 0, start:end].tolist() == list(range(end - start))
    assert fill.sum() == batch["vlm_pack"]["stats"].padded_slots > 0
    assert torch.all(batch["input_ids"][0, fill] == processor.tokenizer.pad_token_id)
    assert torch.all(batch["labels"][0, fill] == IGNORE)
    assert torch.all(batch["mm_token_type_ids"][0, fill] == 0)


def test_padded_mode_is_an_ordinary_right_padded_batch(processor, qwen2_config, examples):
    packed = VLMPackingCollator(processor, max_length=512, model_config=qwen2_config)(examples)
    padded = VLMPackingCollator(processor, max_length=512, model_config=qwen2_config, pack_sequences_in_batch=False)(
        examples
    )
    lengths = packed["vlm_pack"]["seq_lengths"]
    assert padded["input_ids"].shape == (len(examples), int(lengths.max()))
    assert torch.equal(padded["attention_mask"].sum(1), lengths.long())
    assert "position_ids" not in padded and "cu_seq_lens_q" not in padded  # the model derives them
    mask = padded["attention_mask"].bool()
    assert torch.equal(padded["input_ids"][mask], packed["input_ids"][0])
    assert torch.equal(padded["labels"][mask], packed["labels"][0])
    assert torch.all(padded["labels"][~mask] == IGNORE)
    assert torch.equal(padded["pixel_values"], packed["pixel_values"])


def test_text_only_llm_with_a_tokenizer():
    tokenizer = qwen_tokenizer()
    collator = VLMPackingCollator(tokenizer, max_length=512)
    examples = text_chat_examples(4, seed=2)
    batch = collator(examples)
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    assert batch["position_ids"].shape == batch["input_ids"].shape
    for start, end in zip(cu[:-1], cu[1:]):
        assert batch["position_ids"][0, start:end].tolist() == list(range(end - start))
    assert "pixel_values" not in batch and "mm_token_type_ids" not in batch
    assert batch["vlm_pack"]["stats"].images == 0 and batch["vlm_pack"]["stats"].label_tokens > 0


def test_stats_count_the_batch(processor, qwen2_config, collator, examples):
    batch = collator(examples)
    stats = batch["vlm_pack"]["stats"]
    assert isinstance(stats, CollatorStats) and collator.last_stats == stats
    grids = batch["image_grid_thw"]
    assert stats.samples == len(examples) and stats.samples_dropped == 0
    assert stats.real_tokens == batch["input_ids"].shape[1] and stats.padded_slots == 0
    assert stats.images == grids.shape[0] == sum(
        1 for e in examples for m in e["messages"] if isinstance(m["content"], list)
        for part in m["content"] if part["type"] == "image"
    )
    image_slots = int((batch["input_ids"] == processor.image_token_id).sum())
    assert stats.image_tokens == int(grids.prod(-1).sum()) // 4 == image_slots
    assert stats.label_tokens == int((batch["labels"] != IGNORE).sum())
    assert min(stats.encode_s, stats.batch_s, stats.positions_s, stats.pack_s) > 0
    assert stats.padding_fraction == 0.0


def test_image_inputs_in_every_accepted_form_give_the_same_batch(collator):
    photo = sample_photos(56)["coffee"]
    buffer = io.BytesIO()
    photo.save(buffer, format="PNG")
    png = buffer.getvalue()
    answer = {"role": "assistant", "content": "Coffee."}
    question = {"type": "text", "text": "What?"}

    def ask(image_part, **extra):
        return {"messages": [{"role": "user", "content": [image_part, question]}, answer], **extra}

    forms = [
        ask({"type": "image", "image": photo}),
        ask({"type": "image", "image": png}),
        ask({"type": "image", "image": np.asarray(photo)}),
        ask({"type": "image"}, images=[photo]),
        {"messages": [{"role": "user", "content": "<image>What?"}, answer], "images": [{"bytes": png}]},
        ask({"type": "image", "image": photo})["messages"],  # a bare list of turns
    ]
    reference = collator(forms[:1])
    for i, form in enumerate(forms[1:], start=1):
        batch = collator([form])
        for key in ("input_ids", "labels", "pixel_values", "image_grid_thw", "position_ids"):
            assert torch.equal(batch[key], reference[key]), (i, key)


def test_image_from_a_file_path(collator, tmp_path):
    path = tmp_path / "rocket.jpg"
    sample_photos(84)["rocket"].save(path)
    example = {"messages": [{"role": "user", "content": [{"type": "image", "path": str(path)}]},
                            {"role": "assistant", "content": "A rocket."}]}
    assert collator([example])["image_grid_thw"].shape == (1, 3)


def test_real_photos_and_easy_vqa(processor, collator):
    """Real tokenizer + Qwen2VLImageProcessor on skimage photos and easy-vqa files: tokens match pixels."""
    examples = photo_examples(4, seed=3) + easy_vqa_examples(4, seed=3)
    batch = collator(examples)
    grids = batch["image_grid_thw"]
    # each image becomes t*h*w patches of 3*2*14*14 values and t*h*w/4 placeholder tokens
    assert batch["pixel_values"].shape == (int(grids.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == int(grids.prod(-1).sum()) // 4
    assert torch.equal(batch["mm_token_type_ids"] == 1, batch["input_ids"] == processor.image_token_id)
    # every easy-vqa answer is a single word from its answer list, labelled with its end token
    tokenizer = processor.tokenizer
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    answers = [e["messages"][1]["content"] for e in examples[4:]]
    for i, answer in enumerate(answers, start=4):
        labels = batch["labels"][0, cu[i] : cu[i + 1]]
        assert tokenizer.decode(labels[labels != IGNORE]) == answer + "<|im_end|>\n"


def test_dataloader_with_workers_and_pickling(collator):
    examples = easy_vqa_examples(8, seed=4)
    restored = pickle.loads(pickle.dumps(collator))
    expected = [restored(examples[i : i + 4]) for i in (0, 4)]
    loader = DataLoader(examples, batch_size=4, collate_fn=collator, num_workers=2)
    batches = list(loader)
    assert len(batches) == 2
    for got, want in zip(batches, expected):
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "pixel_values", "image_grid_thw"):
            assert torch.equal(got[key], want[key]), key
        # stats computed in the worker travel with the batch
        got_stats, want_stats = got["vlm_pack"]["stats"], want["vlm_pack"]["stats"]
        assert got_stats.samples == 4 and got_stats.images == want_stats.images


def test_model_inputs_drop_labels_and_packing_metadata(collator, examples):
    batch = collator(examples[:2])
    inputs = model_inputs(batch)
    bookkeeping = {"cu_seqlens", "cu_seqlens_padded", "seq_lengths", "stats"}
    assert bookkeeping == batch["vlm_pack"].keys() and not (bookkeeping | {"vlm_pack", "labels"}) & inputs.keys()
    assert {"input_ids", "position_ids", "cu_seq_lens_q", "max_length_k", "pixel_values"} <= inputs.keys()
    assert "labels" in model_inputs(batch, keep_labels=True)


def test_from_packing_config(processor, qwen2_config):
    config = PackingConfig(seq_length=256, micro_batch_size=4, pack_sequences_in_batch=True, context_parallel_size=2)
    collator = VLMPackingCollator.from_config(processor, config, model_config=qwen2_config)
    assert collator.max_length == 256 and collator.pad_to_multiple_of == 4 and collator.pack_sequences_in_batch


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_other_mrope_families_use_their_own_rope_index(processor, family, examples):
    model = tiny_model(family)
    batch = VLMPackingCollator(processor, max_length=512, model_config=model.config)(examples[:2])
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    single = VLMPackingCollator(processor, max_length=512, model_config=model.config, pack_sequences_in_batch=False)(
        examples[1:2]
    )
    expected, _ = model.model.get_rope_index(
        single["input_ids"], mm_token_type_ids=single["mm_token_type_ids"], image_grid_thw=single["image_grid_thw"]
    )
    assert torch.equal(batch["position_ids"][1:, 0, cu[1] : cu[2]], expected[:, 0])


def test_text_only_batches_for_an_mrope_model(processor, qwen2_config):
    """Qwen2-VL on text: through its processor or a bare tokenizer, positions are 4-row aranges per sample."""
    examples = text_chat_examples(3, seed=5)
    via_processor = VLMPackingCollator(processor, max_length=512, model_config=qwen2_config)(examples)
    via_tokenizer = VLMPackingCollator(processor.tokenizer, max_length=512, model_config=qwen2_config,
                                       chat_template=processor.chat_template)(examples)
    assert torch.equal(via_processor["input_ids"], via_tokenizer["input_ids"])
    assert torch.equal(via_processor["position_ids"], via_tokenizer["position_ids"])
    positions = via_tokenizer["position_ids"]
    assert positions.shape == (4, 1, via_tokenizer["input_ids"].shape[1])
    cu = via_tokenizer["vlm_pack"]["cu_seqlens"].tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        assert torch.equal(positions[:, 0, start:end], torch.arange(end - start).expand(4, -1))


def test_own_template_without_assistant_markers_is_kept(qwen2_config):
    """The Qwen tokenizer ships a text template without {% generation %}: the collator renders with it (no
    substitute), tokens exactly as the tokenizer's own apply_chat_template gives them."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_path())
    assert tokenizer.chat_template and "generation %}" not in tokenizer.chat_template
    collator = VLMPackingCollator(tokenizer, max_length=512)
    assert collator.chat_template == tokenizer.chat_template
    examples = text_chat_examples(2)
    batch = collator(examples)
    assert batch["vlm_pack"]["stats"].label_tokens > 0
    expected = [tokenizer.apply_chat_template(e["messages"], tokenize=True, return_dict=True)["input_ids"]
                for e in examples]
    assert batch["input_ids"][0].tolist() == sum(expected, [])
