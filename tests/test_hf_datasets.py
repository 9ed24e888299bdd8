"""``to_hf_dataset``: the datasets views TRL needs, read back unchanged by our collators (no model involved)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from vlm_pack import to_hf_dataset
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.offline.dataset import PackedDataset
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_config


@pytest.fixture(scope="module")
def packs():
    rows = {"input_ids": [list(range(10, 10 + n)) for n in (5, 9, 3, 7, 4)]}
    return PackedDataset(Dataset.from_dict(rows), None, 16)


def test_pack_view_rows_collate_like_the_dataset(packs):
    view = to_hf_dataset(packs)
    assert view.column_names == ["input_ids", "labels", "position_ids", "seq_lengths"] and len(view) == len(packs)
    lazy = list(to_hf_dataset(packs, streaming=True))
    assert lazy == [view[i] for i in range(len(view))]
    for i in range(len(packs)):
        row = view[i]
        trl_row = {k: row[k] for k in ("input_ids", "labels", "seq_lengths")}  # the columns TRL keeps
        ours, theirs = packs.collate([packs[i]]), packs.collate([trl_row])
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
            assert torch.equal(ours[key], theirs[key]), key


def test_a_cut_pack_is_refused(packs):
    row = to_hf_dataset(packs)[0]
    cut = {"input_ids": row["input_ids"][:-2], "labels": row["labels"][:-2], "seq_lengths": row["seq_lengths"]}
    with pytest.raises(ValueError, match="skip_prepare_dataset"):
        packs.collate([cut])
    with pytest.raises(ValueError, match="neither 'position_ids' nor 'seq_lengths'"):
        packs.collate([{"input_ids": row["input_ids"], "labels": row["labels"]}])


def test_chat_view_of_mixed_content_collates_like_the_examples(processor):
    examples = photo_examples(2, seed=1, max_side=56) + text_chat_examples(2, seed=1) + easy_vqa_examples(1, seed=1)
    with pytest.raises(Exception, match="(?i)arrow|struct|list"):  # what users hit without the view
        Dataset.from_list(examples)
    view = to_hf_dataset(examples)
    assert view.column_names == ["messages", "images"]
    collator = VLMPackingCollator(processor, max_length=512, model_config=tiny_config("qwen2_vl"))
    ours, theirs = collator(examples), collator([view[i] for i in range(len(view))])
    for key in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours[key], theirs[key]), key


def test_text_chat_view_has_no_images_column():
    examples = text_chat_examples(3, seed=2)
    view = to_hf_dataset(examples)
    assert view.column_names == ["messages"]
    collator = VLMPackingCollator(qwen_tokenizer(), max_length=512)
    assert torch.equal(collator(examples)["input_ids"], collator(list(view))["input_ids"])
    with pytest.raises(ValueError, match="PackedSFTDataset, a PackedDataset or a list of chat examples"):
        to_hf_dataset("not a dataset")


@pytest.mark.parametrize("field, where", [("reasoning_content", "example 1, turn 1"), ("tool_calls", "example 1, turn 1"),
                                          ("tools", "example 1")])
def test_fields_the_view_cannot_hold_are_refused_not_dropped(field, where):
    """The messages column holds role and content parts only: a reasoning field, tool calls or an example's tools
    (which the template renders) would be lost, so the view refuses them, naming the example and turn."""
    examples = text_chat_examples(2)
    examples[1] = {**examples[1], "messages": [dict(m) for m in examples[1]["messages"]]}
    value = [{"type": "function", "function": {"name": "f", "arguments": {}}}] if field != "reasoning_content" else "Hm."
    if field == "tools":
        examples[1]["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    else:
        examples[1]["messages"][1][field] = value
    assert examples[1]["messages"][1]["role"] == "assistant"
    with pytest.raises(ValueError, match=f"to_hf_dataset: {where} carries .*{field}"):
        to_hf_dataset(examples)
    assert len(to_hf_dataset(examples[:1])) == 1
