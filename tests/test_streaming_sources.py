"""Streaming packs from every kind of ``datasets.IterableDataset`` a user builds: a generator with a list argument
of its own named ``shards`` (the crash of issue 45), a generator with other arguments, in-memory shards,
``interleave_datasets``, a ``map`` / ``filter`` chain. Each at 2 ranks (the generator also at 1) x 2 DataLoader
workers: every row of every shard once per epoch (the rows ``source.shard(n, i)`` yields, read by ``datasets``
alone), and a resume in the first and a later pass (a new source object, the tokenizer loaded from another folder)
equal to the uninterrupted run, which also makes the packs deterministic. The resume fingerprint names a processor
by what changes the packs: the same tokenizer from another folder resumes, another vocabulary or chat template is
refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, IterableDataset, interleave_datasets
from transformers import AutoTokenizer

from vlm_pack import VLMPackingCollator
from vlm_pack.streaming import StreamingPackDataset
from vlm_pack.streaming.trainer import StreamAligner
from vlm_pack.testing.data import text_chat_examples
from vlm_pack.testing.tiny_models import qwen_tokenizer

PACK, BUFFER, WORKERS = 256, 8, 2
PAD_BATCH = {"vlm_pack": {"stream": {"pad": True}}}
EXAMPLES = text_chat_examples(24, seed=21)


def _generator(n, shards):
    """A user's generator whose own list argument is named ``shards`` (here: residues of the row index)."""
    for residue in shards:
        yield from EXAMPLES[residue:n:2]


def _generator_other(limit, offsets, tag="x"):
    for offset in offsets:
        yield from EXAMPLES[offset:limit:3]


def _keep(example):
    return len(example["messages"]) > 0


def _same(example):
    return {"messages": example["messages"]}


SOURCES = {
    "generator_shards_kwarg": lambda: IterableDataset.from_generator(_generator,
                                                                     gen_kwargs={"n": 300, "shards": [0, 1]}),
    "generator_other_kwargs": lambda: IterableDataset.from_generator(
        _generator_other, gen_kwargs={"limit": 300, "offsets": [0, 1, 2], "tag": "y"}),
    "in_memory_shards": lambda: Dataset.from_list(EXAMPLES).to_iterable_dataset(num_shards=3),
    "interleave": lambda: interleave_datasets([Dataset.from_list(EXAMPLES[:12]).to_iterable_dataset(num_shards=2),
                                               Dataset.from_list(EXAMPLES[12:]).to_iterable_dataset(num_shards=2)],
                                              stopping_strategy="all_exhausted"),
    "map_filter": lambda: Dataset.from_list(EXAMPLES).to_iterable_dataset(num_shards=2).map(_same).filter(_keep),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The small Qwen tokenizer saved to two folders and loaded from each (as two nodes would)."""
    base = qwen_tokenizer()
    loaded = []
    for name in ("node_a", "node_b"):
        folder = tmp_path_factory.mktemp(name)
        base.save_pretrained(folder)
        loaded.append(AutoTokenizer.from_pretrained(folder))
    assert loaded[0].name_or_path != loaded[1].name_or_path
    return loaded


def _rows(source) -> set[tuple[int, int]]:
    """Every (shard, row) of the source as datasets itself shards it."""
    return {(s, r) for s in range(source.n_shards)
            for r, _ in enumerate(source.shard(num_shards=source.n_shards, index=s))}


def _fresh(kind, tokenizer, rank, world):
    dataset = StreamingPackDataset(SOURCES[kind](), VLMPackingCollator(tokenizer, max_length=1024), pack_size=PACK,
                                   buffer_size=BUFFER, seed=4, rank=rank, world_size=world)
    return dataset, StreamAligner(dataset, 2, PAD_BATCH, workers=WORKERS)


def _run(dataset, aligner, stop=None):
    """Two epochs pulled through ``aligner`` with 2 workers: ``[(epoch, keys) | ("pad", None)]``; with
    ``stop=(epoch, k)`` the packs up to that one and the state after it."""
    out = []
    for _ in range(2 - aligner.epoch):
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate_fn,
                                             num_workers=WORKERS)
        for batch in aligner.epoch_batches(lambda: loader):
            aligner.consume()
            stream = batch["vlm_pack"]["stream"]
            out.append(("pad", None) if stream.get("pad") else
                       (aligner.consumed_epoch, [tuple(k) for k in stream["samples"]]))
            if stop == (aligner.consumed_epoch, aligner.count):
                return out, json.loads(json.dumps(aligner.state()))
    return out, None


@pytest.mark.parametrize(("kind", "world"), [*((kind, 2) for kind in SOURCES), ("generator_shards_kwarg", 1)])
def test_every_source_packs_every_row_once_and_resumes_from_another_folder(kind, world, tokenizers):
    rows = _rows(SOURCES[kind]())
    assert len(rows) >= 16, kind
    full = [_run(*_fresh(kind, tokenizers[0], rank, world))[0] for rank in range(world)]
    for epoch in (0, 1):
        seen = [key for ranks in full for tag, keys in ranks if tag == epoch for key in keys]
        assert len(seen) == len(rows) and set(seen) == rows, (kind, world, epoch)
    last = world - 1
    for stop in ((0, 2), (1, 1)):
        head, state = _run(*_fresh(kind, tokenizers[0], last, world), stop=stop)
        assert state is not None, stop
        dataset, aligner = _fresh(kind, tokenizers[1], last, world)  # new source object, other tokenizer folder
        aligner.restore(state)
        assert head + _run(dataset, aligner)[0] == full[last], (kind, world, stop)


def _saved_state(tokenizer, kind="generator_shards_kwarg"):
    dataset, aligner = _fresh(kind, tokenizer, 0, 1)
    return _run(dataset, aligner, stop=(0, 1))[1]


def test_a_really_different_tokenizer_or_generator_is_refused(tokenizers, tmp_path):
    state = _saved_state(tokenizers[0])
    other = AutoTokenizer.from_pretrained(tokenizers[0].name_or_path, extra_special_tokens=["<tool_x>"])
    with pytest.raises(ValueError, match=r"made with collator\.vocabulary='[0-9a-f]{16}', this run has "
                                         r"collator\.vocabulary='[0-9a-f]{16}': resume with the settings"):
        _fresh("generator_shards_kwarg", other, 0, 1)[1].restore(state)
    templated = AutoTokenizer.from_pretrained(tokenizers[1].name_or_path)
    templated.chat_template = tokenizers[1].chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(ValueError, match=r"made with collator\.processor_chat_template="):
        _fresh("generator_shards_kwarg", templated, 0, 1)[1].restore(state)
    # the generator's arguments are part of the source: other rows at the same keys are refused
    dataset = StreamingPackDataset(IterableDataset.from_generator(_generator, gen_kwargs={"n": 20, "shards": [0, 1]}),
                                   VLMPackingCollator(tokenizers[0], max_length=1024), pack_size=PACK,
                                   buffer_size=BUFFER, seed=4)
    with pytest.raises(ValueError, match=r"made with source\[0\]\.kwargs='[0-9a-f]{16}'"):
        StreamAligner(dataset, 2, PAD_BATCH, workers=WORKERS).restore(state)


def test_files_resume_from_another_folder(tmp_path, tokenizers):
    """The same JSONL file copied to another folder (another node's disk) resumes; a changed size is refused."""
    from datasets import load_dataset

    paths = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "chats.jsonl")
        paths[-1].write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))

    def fresh(path):
        source = load_dataset("json", data_files=[str(path)], split="train", streaming=True)
        dataset = StreamingPackDataset(source, VLMPackingCollator(tokenizers[0], max_length=1024), pack_size=PACK,
                                       buffer_size=BUFFER, seed=4)
        return dataset, StreamAligner(dataset, 2, PAD_BATCH)

    state = json.loads(json.dumps(fresh(paths[0])[1].state()))
    fresh(paths[1])[1].restore(state)
    paths[1].write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES[:-1]))
    with pytest.raises(ValueError, match=r"made with source\[0\]\.files\[0\]\[1\]=\d+, this run has "
                                         r"source\[0\]\.files\[0\]\[1\]=\d+: resume"):
        fresh(paths[1])[1].restore(state)


def test_a_stream_without_shards_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^source must be a sharded datasets\.IterableDataset .*; got list$"):
        StreamingPackDataset([{"messages": []}], VLMPackingCollator(qwen_tokenizer(), max_length=1024), pack_size=PACK)
