"""Streaming packs: the inputs the suite lacked when planted bugs survived it (issue 45). Left-over shards dealt
with rotation (per-unit balance), a resume at ``dataloader_num_workers=0`` (Trainer's default), a failure on rank 0
(only rank 1 ever failed in tests), and the fill warning measured against 0.9x offline best fit (not 0.9).
scripts/replay_mutants.sh plants each mutant and expects these to fail."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from vlm_pack import VLMPackingCollator
from vlm_pack.streaming import StreamingPackDataset
from vlm_pack.streaming.dataset import deal
from vlm_pack.streaming.trainer import _DATA, _FAILED, StreamAligner
from vlm_pack.testing.data import text_chat_examples
from vlm_pack.testing.tiny_models import qwen_tokenizer

PACK, BUFFER = 256, 8
PAD_BATCH = {"vlm_pack": {"stream": {"pad": True}}}


@pytest.fixture(scope="module")
def collator():
    return VLMPackingCollator(qwen_tokenizer(), max_length=1024)


def _source(shards=3):
    return Dataset.from_list(text_chat_examples(24, seed=31)).to_iterable_dataset(num_shards=shards)


@pytest.mark.parametrize("rows, units", [([1, 1, 1], 4), ([3] * 6, 4), ([2] * 5, 3)])
def test_left_over_shards_rotate_so_units_stay_within_one_row(rows, units):
    """Short left-over shards split by example: without the rotation every one of them gives its first rows to the
    same units. Per-unit rows differ by at most one (whole shards of equal size here)."""
    per_unit = [sum(1 for shard, stride, offset in parts for row in range(rows[shard]) if row % stride == offset)
                for parts in deal(list(range(len(rows))), units)]
    assert sum(per_unit) == sum(rows)
    assert max(per_unit) - min(per_unit) <= 1, per_unit


def _run(dataset, aligner, stop=None):
    out = []
    for _ in range(2 - aligner.epoch):
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate_fn, num_workers=0)
        for batch in aligner.epoch_batches(lambda: loader):
            aligner.consume()
            stream = batch["vlm_pack"]["stream"]
            out.append(("pad", None) if stream.get("pad") else
                       (aligner.consumed_epoch, [tuple(k) for k in stream["samples"]]))
            if stop == (aligner.consumed_epoch, aligner.count):
                return out, json.loads(json.dumps(aligner.state()))
    return out, None


@pytest.mark.parametrize("stop", [(0, 2), (1, 1)], ids=["first-pass", "second-pass"])
def test_resume_at_zero_dataloader_workers_equals_the_uninterrupted_run(collator, stop):
    """Trainer's default dataloader_num_workers=0 saves and restores its state like any other count."""
    def fresh():
        dataset = StreamingPackDataset(_source(), collator, pack_size=PACK, buffer_size=BUFFER, seed=2)
        return dataset, StreamAligner(dataset, 2, PAD_BATCH, workers=0)

    full, _ = _run(*fresh())
    head, state = _run(*fresh(), stop=stop)
    assert state["fingerprint"]["dataloader_num_workers"] == 0
    dataset, aligner = fresh()
    aligner.restore(state)
    assert head + _run(dataset, aligner)[0] == full


def test_a_failure_on_rank_0_stops_rank_1_at_the_same_pull(collator):
    """Rank 0's pipeline raised: it reports _FAILED + 0, the largest code of the pull; rank 1 (data in hand) stops
    naming rank 0 instead of waiting in a collective rank 0 never joins."""
    dataset = StreamingPackDataset(_source(), collator, pack_size=PACK, buffer_size=BUFFER, rank=1, world_size=2)
    reported = []

    def sync(code):
        reported.append(code)
        return max(code, _FAILED + 0)

    aligner = StreamAligner(dataset, 1, PAD_BATCH, sync=sync)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate_fn)
    with pytest.raises(RuntimeError, match=r"^rank 0 failed reading its streaming packs .* rank 1 stops at the same "
                                           r"pull"):
        next(iter(aligner.epoch_batches(lambda: loader)))
    assert reported == [_DATA]


@pytest.mark.parametrize("share, warned", [(0.6, False), (0.3, True)])
def test_fill_warning_compares_with_best_fit_not_with_a_constant(collator, caplog, share, warned):
    """Samples of 0.6 x the pack: one per pack whatever the buffer, so the fill (0.6) IS offline best fit's and no
    buffer would do better: no warning, though 0.6 < 0.9. Samples of 0.3 x the pack with a buffer of 1: fill 0.3
    against best fit's 0.9: warned."""
    dataset = StreamingPackDataset(_source(), collator, pack_size=1000, buffer_size=1)
    aligner = StreamAligner(dataset, 1, PAD_BATCH)
    with caplog.at_level("WARNING", logger="vlm_pack.streaming.trainer"):
        aligner._check_fill([int(share * 1000)] * 32)
    assert ("buffer_size=1 is too small to pack" in caplog.text) is warned, caplog.text
