"""Streaming token-budget packs (vlm_pack.streaming): every sample in exactly one pack per epoch across DataLoader
workers and data-parallel ranks, deterministic per seed, fill close to offline best-fit decreasing, memory bounded
by the look-ahead, and a resume (Trainer checkpoints in the first and a later pass) equal to the uninterrupted run.
Each rule has a corruption that fails: leftovers dropped, an unseeded shuffle, a restart without the saved state."""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc

import numpy as np
import pytest
import torch
from datasets import load_dataset

from vlm_pack import VLMPackingCollator
from vlm_pack.budget import measure_lengths
from vlm_pack.offline.algorithms import best_fit_decreasing
from vlm_pack.streaming import BufferedBestFit, StreamingPackCallback, StreamingPackDataset
from vlm_pack.streaming.dataset import deal
from vlm_pack.streaming.trainer import StreamAligner, loss_free_pack
from vlm_pack.testing.data import text_chat_examples
from vlm_pack.testing.tiny_models import qwen_tokenizer

SHARDS, PACK, BUFFER = 4, 256, 16
PAD_BATCH = {"vlm_pack": {"stream": {"pad": True}}}  # a loss-free pack's stand-in for StreamAligner


@pytest.fixture(scope="module")
def text_collator():
    return VLMPackingCollator(qwen_tokenizer(), max_length=1024)


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """The same 48 long-tailed chats as 4 JSONL files and as 4 parquet files (uneven shard sizes), and as JSONL
    streams of fewer files than 2 ranks x 2 workers: one file ("one"), two of 20 and 28 ("two")."""
    import pandas as pd

    root = tmp_path_factory.mktemp("streams")
    examples = text_chat_examples(48, seed=7)
    cuts = [0, 8, 20, 30, 48]
    files = {"json": [], "parquet": []}
    for s in range(SHARDS):
        part = examples[cuts[s]:cuts[s + 1]]
        (root / f"part{s}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in part))
        pd.DataFrame({"messages": [e["messages"] for e in part]}).to_parquet(root / f"part{s}.parquet")
        files["json"].append(str(root / f"part{s}.jsonl"))
        files["parquet"].append(str(root / f"part{s}.parquet"))
    for name, parts in (("one", [examples]), ("two", [examples[:20], examples[20:]])):
        files[name] = []
        for s, part in enumerate(parts):
            (root / f"{name}{s}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in part))
            files[name].append(str(root / f"{name}{s}.jsonl"))
    return files, len(examples)


def _source(streams, kind):
    builder = "parquet" if kind == "parquet" else "json"
    return load_dataset(builder, data_files=streams[0][kind], split="train", streaming=True)


def _epoch(dataset, epoch, workers=2):
    """One epoch of ``dataset`` through a DataLoader: the packs' sample keys (``(shard, row)`` lists)."""
    dataset.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate_fn, num_workers=workers)
    return [[tuple(key) for key in batch["vlm_pack"]["stream"]["samples"]] for batch in loader]


def _exactly_once(packs_per_rank, total):
    seen = [key for packs in packs_per_rank for pack in packs for key in pack]
    return len(seen) == total and len(set(seen)) == total


# ---------------------------------------------------------------- the packer alone


def _run_packer(lengths, buffer, packer_cls=BufferedBestFit, seed=(0, 0, 0), stop_at=None, state=None):
    packer = packer_cls(PACK, buffer, seed)
    start = 0
    if state is not None:
        packer.load_state_dict(state["packer"])
        start = state["next"]
    packs = []
    for i in range(start, len(lengths)):
        packer.add((0, i), int(lengths[i]))
        if packer.full:
            packs.append([s.key[1] for s in packer.cut()])
            if stop_at is not None and len(packs) == stop_at:
                return packs, {"packer": packer.state_dict(), "next": i + 1}
    while len(packer):
        packs.append([s.key[1] for s in packer.cut()])
    return packs, None


class _DropsLeftovers(BufferedBestFit):
    """Corruption: the buffer's tail at the end of the stream is thrown away."""

    def __len__(self):
        return 0 if not self.full else super().__len__()


class _Unseeded(BufferedBestFit):
    """Corruption: the opener is drawn from an unseeded generator."""

    def cut(self):
        self.seed = (int(np.random.default_rng().integers(2**31)),)
        return super().cut()


def test_packer_places_every_sample_once_within_the_budget_and_resumes_exactly():
    lengths = np.random.default_rng(0).integers(5, PACK, size=400)
    packs, _ = _run_packer(lengths, 24)
    assert sorted(i for p in packs for i in p) == list(range(400))
    assert max(int(lengths[p].sum()) for p in packs) <= PACK
    assert _run_packer(lengths, 24)[0] == packs  # deterministic
    head, state = _run_packer(lengths, 24, stop_at=37)
    tail, _ = _run_packer(lengths, 24, state=json.loads(json.dumps(state)))
    assert head + tail == packs
    # corruptions: leftovers dropped lose samples; an unseeded shuffle is not reproducible
    dropped, _ = _run_packer(lengths, 24, packer_cls=_DropsLeftovers)
    assert sorted(i for p in dropped for i in p) != list(range(400))
    assert _run_packer(lengths, 24, packer_cls=_Unseeded)[0] != _run_packer(lengths, 24, packer_cls=_Unseeded)[0]


def test_fill_against_offline_best_fit_decreasing():
    """Long-tailed lengths, pack 4096: packs of offline BFD / packs of the stream >= 0.95 from a 64-sample buffer."""
    rng = np.random.default_rng(1)
    lengths = np.minimum((rng.pareto(1.5, 6000) * 150 + 30).astype(int), 4096)
    bfd = int(best_fit_decreasing(lengths, 4096).max()) + 1
    packs = BufferedBestFit(4096, 64, (0, 0, 0)).count_packs(lengths.tolist())
    print(f"fill vs BFD at buffer 64: {bfd / packs:.4f} ({packs} packs, BFD {bfd})")
    assert bfd / packs >= 0.95


# ---------------------------------------------------------------- the dataset: workers, ranks, epochs


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_every_sample_once_per_epoch_across_workers_and_ranks(streams, text_collator, kind):
    """2 workers; 1 rank and 2 ranks (the dataset's rank/world arguments); 2 epochs; seeded."""
    source, total = _source(streams, kind), streams[1]
    orders = {}
    for world in (1, 2):
        for epoch in (0, 1):
            per_rank = [_epoch(StreamingPackDataset(source, text_collator, pack_size=PACK, buffer_size=BUFFER,
                                                    seed=5, rank=r, world_size=world), epoch) for r in range(world)]
            assert _exactly_once(per_rank, total), (world, epoch)
            orders[world, epoch] = per_rank
    assert orders[1, 0] != orders[1, 1]  # reshuffled per epoch
    lengths = measure_lengths(list(source), text_collator, progress=False).tokens
    bfd = int(best_fit_decreasing(lengths, PACK).max()) + 1
    for world in (1, 2):
        packs = sum(len(rank) for rank in orders[world, 0])
        print(f"{kind}, {world} rank(s) x 2 workers: {packs} packs, offline BFD {bfd}: fill ratio {bfd / packs:.3f}")
        # each unit drains its own buffer at its epoch end: at most one partly filled pack more per extra unit
        assert bfd / packs >= 0.95 if world == 1 else packs <= bfd + 2 * world - 1
    again = _epoch(StreamingPackDataset(source, text_collator, pack_size=PACK, buffer_size=BUFFER, seed=5), 1)
    assert [again] == orders[1, 1]  # same seed, same packs


def test_deal_gives_every_row_of_every_shard_to_exactly_one_unit():
    """Whole shards while every unit gets one more, the rest split by example; any shard count, row count, units."""
    rng = np.random.default_rng(0)
    for shards, units in ((8, 4), (5, 4), (3, 4), (1, 4), (2, 2), (7, 3)):
        rows = rng.integers(0, 9, size=shards).tolist()
        order = rng.permutation(shards).tolist()
        lists = deal(order, units)
        taken = [(shard, row) for parts in lists for shard, stride, offset in parts
                 for row in range(rows[shard]) if row % stride == offset]
        assert sorted(taken) == [(s, r) for s in range(shards) for r in range(rows[s])], (shards, units)
        whole = [shard for parts in lists for shard, stride, _ in parts if stride == 1]
        assert len(whole) == shards - shards % units  # every shard that can be dealt whole is
    # corruption: every unit keeping the same residue of a split shard reads its rows units times
    taken = [row for parts in deal([0], 4) for _, stride, _ in parts for row in range(8) if row % stride == 0]
    assert sorted(taken) != list(range(8))


def test_shards_are_dealt_differently_every_epoch(streams, text_collator):
    """The shard order (and so the shards each unit reads) is drawn from (seed, epoch); the same per seed."""
    dataset = StreamingPackDataset(_source(streams, "json"), text_collator, pack_size=PACK, seed=5)
    lists = [dataset.read_lists(epoch, workers=2) for epoch in range(4)]
    assert len({json.dumps(unit_lists) for unit_lists in lists}) > 1
    assert all(sorted(s for parts in unit_lists for s, _, _ in parts) == list(range(SHARDS)) for unit_lists in lists)
    again = StreamingPackDataset(_source(streams, "json"), text_collator, pack_size=PACK, seed=5)
    assert [again.read_lists(epoch, workers=2) for epoch in range(4)] == lists


def test_one_shard_per_unit_still_packs_differently_every_epoch(streams, text_collator):
    """A one-file stream read by one unit: the same shard every epoch, so only the buffer's shuffle, drawn from
    (seed, epoch, unit, pack), can make the epochs differ."""
    dataset = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=PACK, buffer_size=BUFFER, seed=5)
    first, second = _epoch(dataset, 0, workers=0), _epoch(dataset, 1, workers=0)
    assert sorted(k for p in first for k in p) == sorted(k for p in second for k in p)
    assert first != second


@pytest.mark.parametrize("kind", ["one", "two"])
def test_fewer_shards_than_units_once_per_epoch_deterministic_and_resumable(streams, text_collator, kind, caplog):
    """One and two JSONL files on 2 ranks x 2 workers (4 units: every unit reads every file and keeps its rows):
    each epoch holds every sample once across the ranks, the same seed gives the same packs, and a resume in the
    first and a later pass (rank 1's StreamAligner state, JSON round trip) continues exactly."""
    source, total = _source(streams, kind), streams[1]

    def fresh(rank):
        dataset = StreamingPackDataset(source, text_collator, pack_size=PACK, buffer_size=BUFFER, seed=5, rank=rank,
                                       world_size=2)
        return dataset, StreamAligner(dataset, 2, PAD_BATCH, workers=2)

    with caplog.at_level("INFO", logger="vlm_pack.streaming.trainer"):
        full = [_aligned(*fresh(rank))[0] for rank in range(2)]
    assert "split by example (every unit reads them and keeps every 4-th row)" in caplog.text
    assert caplog.text.count("rank x worker units") == 1  # rank 0 logs the deal, once
    for epoch in (0, 1):
        packs = [[keys for tag, keys in rank_packs if tag == epoch] for rank_packs in full]
        assert all(packs) and _exactly_once(packs, total), epoch
    assert _aligned(*fresh(1))[0] == full[1]  # deterministic
    for stop in ((0, 3), (1, 1)):
        head, state = _aligned(*fresh(1), epoch_stop=stop)
        dataset, aligner = fresh(1)
        aligner.restore(state)
        assert head + _aligned(dataset, aligner)[0] == full[1], stop


def test_an_overlong_sample_is_named_by_file_and_line(streams, text_collator):
    """Text: the message names the file and line and counts tokens; nothing about images."""
    dataset = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=64)
    file = streams[0]["one"][0]
    with pytest.raises(ValueError, match=rf"^{file} line \d+ has \d+ tokens, more than pack_size=64: raise pack_size ")\
            as caught:
        _epoch(dataset, 0, workers=0)
    assert "image" not in str(caught.value)
    line = int(str(caught.value).split(" line ")[1].split()[0])
    length = measure_lengths([text_chat_examples(48, seed=7)[line - 1]], text_collator, progress=False).tokens[0]
    assert length > 64 and f"has {length} tokens" in str(caught.value)  # that line is the over-long one


def test_a_smaller_pack_size_after_a_resume_names_a_sample_it_cannot_hold(streams, text_collator):
    """The refusal names pack_size with both values and a waiting sample of the saved state too long for the new
    size (its file, line and tokens)."""
    dataset = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=PACK, buffer_size=BUFFER, seed=5)
    aligner = StreamAligner(dataset, 1, PAD_BATCH)
    for _ in zip(range(2), aligner.epoch_batches(lambda: dataset)):
        aligner.consume()
    state = json.loads(json.dumps(aligner.state()))
    longest = max(length for _, _, length, _ in state["units"]["0"]["packer"]["waiting"])
    smaller = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=longest - 1, buffer_size=BUFFER,
                                   seed=5)
    file = streams[0]["one"][0]
    with pytest.raises(ValueError, match=rf"made with pack_size={PACK}, this run has pack_size={longest - 1}: .*"
                                         rf"\(e\.g\. {file} line \d+, waiting in the saved state, has \d+ tokens\)"):
        StreamAligner(smaller, 1, PAD_BATCH).restore(state)


def test_a_buffer_too_small_to_pack_warns_with_the_predicted_fill(streams, text_collator, caplog):
    """buffer_size=1 packs one sample per pack: warned (the fill predicted from the first 32 lengths, beside offline
    best fit's); a buffer of 64 is not."""
    fills = {}
    for buffer in (1, 64):
        dataset = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=PACK, buffer_size=buffer)
        aligner = StreamAligner(dataset, 1, PAD_BATCH)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vlm_pack.streaming.trainer"):
            for _ in aligner.epoch_batches(lambda: dataset):
                aligner.consume()
        fills[buffer] = caplog.text
    found = re.search(r"buffer_size=1 is too small to pack: packs of 256 tokens hold ~[\d.]+ samples, predicted fill "
                      r"(0\.\d+) \(offline best fit (0\.\d+)\)", fills[1])
    assert found and float(found[1]) < 0.9 * float(found[2]), fills[1]
    assert fills[64] == ""


def _aligned(dataset, aligner, epoch_stop=None):
    """Pull through ``aligner`` (consuming each pack as a training step would); stop after ``epoch_stop=(e, k)``."""
    out = []
    for _ in range(2 - aligner.epoch):
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate_fn, num_workers=2)
        for batch in aligner.epoch_batches(lambda: loader):
            aligner.consume()
            stream = batch["vlm_pack"]["stream"]
            out.append(("pad", None) if stream.get("pad") else
                       (aligner.consumed_epoch, [tuple(k) for k in stream["samples"]]))
            if epoch_stop == (aligner.consumed_epoch, aligner.count):
                return out, json.loads(json.dumps(aligner.state()))
    return out, None


@pytest.mark.parametrize("stop", [(0, 3), (1, 5)], ids=["first-pass", "second-pass"])
def test_resume_from_any_pack_equals_the_uninterrupted_run(streams, text_collator, stop):
    source = _source(streams, "parquet")

    def fresh():
        dataset = StreamingPackDataset(source, text_collator, pack_size=PACK, buffer_size=BUFFER, seed=5)
        return dataset, StreamAligner(dataset, 2, PAD_BATCH)

    full, _ = _aligned(*fresh())
    head, state = _aligned(*fresh(), epoch_stop=stop)
    dataset, aligner = fresh()
    aligner.restore(state)
    tail, _ = _aligned(dataset, aligner)
    assert head + tail == full
    assert len(full) % 2 == 0
    # corruption: a restart without the saved state repeats the epoch's first packs
    dataset, aligner = fresh()
    aligner.epoch = stop[0]
    restarted, _ = _aligned(dataset, aligner)
    assert head + restarted != full


def test_peak_memory_does_not_grow_with_the_stream(tmp_path, text_collator):
    """Python heap peak while streaming 60 vs 240 samples (same buffer): bounded by the look-ahead."""
    examples = text_chat_examples(240, seed=3)
    peaks = []
    for n in (60, 240):
        files = []
        for s in range(2):
            path = tmp_path / f"n{n}-{s}.jsonl"
            path.write_text("".join(json.dumps(e) + "\n" for e in examples[s:n:2]))
            files.append(str(path))
        dataset = StreamingPackDataset(load_dataset("json", data_files=files, split="train", streaming=True),
                                       text_collator, pack_size=PACK, buffer_size=BUFFER)
        tracemalloc.start()
        count = sum(1 for _ in dataset)
        peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
        tracemalloc.stop()
        assert count > 0
    print(f"peak Python heap: {peaks[0]:.2f} MiB (60 samples) vs {peaks[1]:.2f} MiB (240)")
    assert peaks[1] < 1.25 * peaks[0]


# ---------------------------------------------------------------- Trainer and TRL


def _trainer_run(streams, text_collator, out, resume=None, seed=5, pack_size=512, buffer_size=BUFFER, workers=2,
                 **extra):
    """Plain Trainer, tiny Qwen2 LLM, JSONL stream at pack 512, 2 workers, GA 2, 9 steps, a checkpoint
    every 2 steps; returns (each forward's sample keys or "pad", final weights)."""
    from transformers import Trainer, TrainingArguments

    from vlm_pack import enable_packing
    from vlm_pack.testing.tiny_models import _SMALL_VOCAB, tiny_model

    model = enable_packing(tiny_model("qwen2", layers=1, vocab_size=_SMALL_VOCAB))
    seen = []
    model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["vlm_pack"]["stream"].get("samples", "pad")), with_kwargs=True)
    dataset = StreamingPackDataset(_source(streams, "json"), text_collator, pack_size=pack_size,
                                   buffer_size=buffer_size, seed=seed)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=9,
        optim="sgd", learning_rate=0.1, use_cpu=True, report_to="none", save_strategy="steps", save_steps=2,
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=workers, remove_unused_columns=False,
        ignore_data_skip=True, accelerator_config={"dispatch_batches": False}, **extra)
    run = Trainer(model=model, args=args, train_dataset=dataset, data_collator=dataset.collate_fn,
                  callbacks=[StreamingPackCallback(dataset)])
    run.train(resume_from_checkpoint=resume)
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_resumes_in_the_first_and_a_later_pass_like_the_uninterrupted_run(streams, text_collator, tmp_path):
    """The plain recipe (``train(resume_from_checkpoint=PATH)``): from checkpoint-2 (first pass) in place and from a
    copy of checkpoint-6 (second pass) in another folder, with another output_dir; the stream state travels in
    the checkpoint's trainer_state.json. A resume with another seed, pack size, buffer size or number of workers is
    refused, naming the setting and both values."""
    full, weights = _trainer_run(streams, text_collator, tmp_path / "run")
    packs = [step for step in full if step != "pad"]
    first_pass_packs = next(i for i in range(len(packs) + 1)
                            if sum(len(p) for p in packs[:i]) == streams[1])  # the first pass is whole...
    assert len({tuple(k) for p in packs[:first_pass_packs] for k in p}) == streams[1]
    assert 2 * 2 < first_pass_packs < 2 * 6  # ...and checkpoint-2 is in it, checkpoint-6 in the second pass
    copy = tmp_path / "elsewhere" / "saved-at-6"
    shutil.copytree(tmp_path / "run" / "checkpoint-6", copy)
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    # checkpoint-2 with Trainer's restore_callback_states_from_checkpoint (it rebuilds the callback, no arguments)
    for step, folder, out, restore in ((2, tmp_path / "run" / "checkpoint-2", tmp_path / "run", True),
                                       (6, copy, tmp_path / "new", False)):
        resumed, resumed_weights = _trainer_run(streams, text_collator, out, resume=str(folder),
                                                restore_callback_states_from_checkpoint=restore)
        assert resumed == full[2 * step:], step
        print(f"resumed from {folder.name}: {len(resumed)} forwards identical, weights equal")
        assert all(torch.equal(resumed_weights[n], weights[n]) for n in weights), step
    for setting, value, was in (("seed", 6, 5), ("pack_size", 384, 512), ("buffer_size", 8, BUFFER),
                                ("workers", 0, 2)):
        name = "dataloader_num_workers" if setting == "workers" else setting
        with pytest.raises(ValueError, match=rf"made with {name}={was}, this run has {name}={value}: "):
            _trainer_run(streams, text_collator, tmp_path / "new", resume=str(copy), **{setting: value})
    # corruption: a checkpoint without the stream state is refused (restarting would repeat and skip samples)
    state = json.loads((copy / "trainer_state.json").read_text())
    del state["stateful_callbacks"]["StreamingPackCallback"]
    (copy / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="stream position is unknown"):
        _trainer_run(streams, text_collator, tmp_path / "new", resume=str(copy))


def test_packed_sft_trainer_resumes_from_a_copied_checkpoint(streams, text_collator, tmp_path):
    """TRL's PackedSFTTrainer, the plain recipe: one JSONL file on 2 workers (split by example), 5 steps; resumed
    from a copy of checkpoint-2 in another folder, the forwards after it and the final weights equal the
    uninterrupted run's."""
    from test_trainer import sft_config

    from vlm_pack import PackedSFTTrainer, enable_packing
    from vlm_pack.testing.tiny_models import _SMALL_VOCAB, tiny_model

    def run(out, resume=None):
        model = enable_packing(tiny_model("qwen2", layers=1, vocab_size=_SMALL_VOCAB))
        seen = []
        model.register_forward_pre_hook(
            lambda m, a, k: seen.append(k["vlm_pack"]["stream"].get("samples", "pad")), with_kwargs=True)
        packs = StreamingPackDataset(_source(streams, "one"), text_collator, pack_size=PACK, buffer_size=BUFFER, seed=2)
        args = sft_config(out, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=5,
                          dataloader_num_workers=2, save_strategy="steps", save_steps=2)
        PackedSFTTrainer(model=model, args=args, train_dataset=packs,
                         processing_class=text_collator.processor).train(resume_from_checkpoint=resume)
        return seen, [p.detach().clone() for p in model.parameters()]

    full, weights = run(tmp_path / "run")
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "copy")
    shutil.rmtree(tmp_path / "run")
    resumed, resumed_weights = run(tmp_path / "again", resume=str(tmp_path / "copy"))
    assert len(full) == 5 and resumed == full[2:]
    assert all(torch.equal(a, b) for a, b in zip(resumed_weights, weights))


def test_trainer_without_ignore_data_skip_is_refused(streams, text_collator, tmp_path):
    from transformers import Trainer, TrainingArguments

    from vlm_pack.testing.tiny_models import _SMALL_VOCAB, tiny_model

    dataset = StreamingPackDataset(_source(streams, "json"), text_collator, pack_size=PACK)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=1, use_cpu=True,
                             report_to="none", accelerator_config={"dispatch_batches": False})
    with pytest.raises(ValueError, match="ignore_data_skip=True"):
        Trainer(model=tiny_model("qwen2", layers=1, vocab_size=_SMALL_VOCAB), args=args, train_dataset=dataset,
                data_collator=dataset.collate_fn, callbacks=[StreamingPackCallback(dataset)])


def test_loss_free_pack_counts_no_token(text_collator, streams):
    dataset = StreamingPackDataset(_source(streams, "json"), text_collator, pack_size=PACK)
    pad = loss_free_pack(dataset)
    assert int((pad["labels"] != -100).sum()) == 0 and pad["input_ids"].shape[1] > 0


def test_packed_sft_trainer_on_an_image_stream_equals_each_sample_alone(processor, tmp_path):
    """TRL (PackedSFTTrainer) on a 2-shard stream of photos, VQA images and text, 2 workers: the first step's
    gradient (its packs' samples, a token mean over the window) equals each of those samples run ALONE through the
    stock sdpa Qwen2-VL (tests/test_trainer.py's reference)."""
    from test_trainer import GradCapture, reference_grads, relative_error, sft_config
    from tolerance import GRAD_REL_L2

    from vlm_pack import PackedSFTTrainer, enable_packing, to_hf_dataset
    from vlm_pack.testing.data import easy_vqa_examples, photo_examples
    from vlm_pack.testing.tiny_models import tiny_model

    examples = photo_examples(3, seed=5, max_side=56) + easy_vqa_examples(2, seed=5) + text_chat_examples(3, seed=5)
    source = to_hf_dataset(examples).to_iterable_dataset(num_shards=2)
    rows = {(s, r): row for s in range(2) for r, row in enumerate(source.shard(num_shards=2, index=s))}
    model = enable_packing(tiny_model("qwen2_vl", layers=1))
    collator = VLMPackingCollator(processor, max_length=512, model_config=model.config)
    packs = StreamingPackDataset(source, collator, pack_size=384, buffer_size=4, seed=1)
    seen = []
    model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["vlm_pack"]["stream"].get("samples", [])), with_kwargs=True)
    capture = GradCapture()
    args = sft_config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                      dataloader_num_workers=2)
    PackedSFTTrainer(model=model, args=args, train_dataset=packs, processing_class=processor,
                     callbacks=[capture]).train()
    chosen = [rows[tuple(key)] for pack in seen[:2] for key in pack]
    assert any(row["images"] for row in chosen) and len(chosen) >= 3
    error = relative_error(capture.grads, reference_grads("qwen2_vl", processor, chosen))
    print(f"streaming packs through TRL, {len(chosen)} samples in step 1: relative L2 {error:.2e}")
    assert error < GRAD_REL_L2
