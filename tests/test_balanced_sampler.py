"""BalancedPackingSampler: DistributedSampler semantics (coverage, determinism, resume) and load balance."""

from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from vlm_pack.core.distributed import BalancedPackingSampler


def _long_tail(n, seed=0):
    """Lognormal text lengths plus Zipf-many images of a few sizes; token length includes image tokens."""
    rng = np.random.default_rng(seed)
    text = np.clip(rng.lognormal(np.log(300), 1.0, n), 8, 16384).astype(np.int64)
    images = np.where(rng.random(n) < 0.5, np.minimum(rng.zipf(2.0, n), 8), 0)
    image_tokens = images * rng.choice([64, 256, 576, 1024], n, p=[0.3, 0.4, 0.2, 0.1])
    return text + image_tokens, image_tokens


def _samplers(lengths, images=None, replicas=4, **kwargs):
    return [
        BalancedPackingSampler(lengths, images, num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)
    ]


def _epoch(samplers):
    """Per-rank list of micro-batches for one epoch."""
    return [list(s) for s in samplers]


def test_every_sample_exactly_once_when_divisible():
    lengths, images = _long_tail(96)
    per_rank = _epoch(_samplers(lengths, images, micro_batch_size=4, window_steps=2))
    assert [len(batches) for batches in per_rank] == [6, 6, 6, 6]
    assert all(len(mb) == 4 for batches in per_rank for mb in batches)
    seen = [i for batches in per_rank for mb in batches for i in mb]
    assert sorted(seen) == list(range(96))


def test_remainder_repeats_head_or_drops_tail():
    lengths, images = _long_tail(101)
    padded = _epoch(_samplers(lengths, images, micro_batch_size=4))
    seen = Counter(i for batches in padded for mb in batches for i in mb)
    assert set(seen) == set(range(101))  # every sample at least once
    assert sum(seen.values()) == 7 * 16 and max(seen.values()) == 2  # 11 repeats < 4 * 4
    assert len({len(batches) for batches in padded}) == 1

    dropped = _epoch(_samplers(lengths, images, micro_batch_size=4, drop_last=True))
    seen = Counter(i for batches in dropped for mb in batches for i in mb)
    assert sum(seen.values()) == 6 * 16 and max(seen.values()) == 1  # at most once, 5 dropped
    assert [len(b) for b in dropped] == [6, 6, 6, 6]


def test_len_matches_iteration_and_dataloader():
    lengths, images = _long_tail(50)
    sampler = BalancedPackingSampler(lengths, images, micro_batch_size=3, num_replicas=2, rank=1)
    assert len(sampler) == sampler.num_steps == 9
    loader = DataLoader(list(range(50)), batch_sampler=sampler, collate_fn=list)
    batches = list(loader)
    assert len(batches) == len(loader) == 9
    assert batches == list(sampler)  # the loader uses the sampler's micro-batches as they are


def test_deterministic_by_seed_and_epoch():
    lengths, images = _long_tail(200)
    a = BalancedPackingSampler(lengths, images, micro_batch_size=4, num_replicas=2, rank=0, seed=7)
    b = BalancedPackingSampler(lengths, images, micro_batch_size=4, num_replicas=2, rank=0, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    c = BalancedPackingSampler(lengths, images, micro_batch_size=4, num_replicas=2, rank=0, seed=8)
    assert list(c) != first


def test_ranks_share_one_plan():
    lengths, images = _long_tail(120)
    samplers = _samplers(lengths, images, replicas=3, micro_batch_size=5, seed=3)
    plan = samplers[0].epoch_plan()
    assert plan.shape == (8, 3, 5)
    for rank, sampler in enumerate(samplers):
        assert list(sampler) == plan[:, rank].tolist()


def test_shuffle_false_covers_in_a_fixed_order():
    lengths, images = _long_tail(64)
    a = _epoch(_samplers(lengths, images, micro_batch_size=4, shuffle=False))
    b = _epoch(_samplers(lengths, images, micro_batch_size=4, shuffle=False, seed=99))
    assert a == b
    assert sorted(i for batches in a for mb in batches for i in mb) == list(range(64))


def test_resume_mid_epoch():
    lengths, images = _long_tail(300)
    kwargs = dict(micro_batch_size=4, num_replicas=3, rank=2, seed=5)
    sampler = BalancedPackingSampler(lengths, images, **kwargs)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.set_epoch(3)  # same epoch: position kept, the epoch is finished -> next iteration replays it
    assert list(sampler) == full
    sampler = BalancedPackingSampler(lengths, images, **kwargs)
    sampler.set_epoch(3)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(10)]
    state = sampler.state_dict()
    assert state["epoch"] == 3 and state["next_micro_batch"] == 10

    other_rank = BalancedPackingSampler(lengths, images, **{**kwargs, "rank": 0})  # ranks share the state
    other_rank.load_state_dict(state)
    assert list(other_rank) == sampler.epoch_plan()[10:, 0].tolist()
    resumed = BalancedPackingSampler(lengths, images, **kwargs)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # training loops call set_epoch on resume: it must not rewind
    assert len(resumed) == len(full) - 10
    assert head + list(resumed) == full
    resumed.set_epoch(4)
    assert len(resumed) == len(full) and list(resumed) != full

    # With a prefetching DataLoader, record what was consumed rather than handed out.
    consumed = sampler.state_dict(micro_batches_consumed=7)
    again = BalancedPackingSampler(lengths, images, **kwargs)
    again.load_state_dict(consumed)
    assert list(again) == full[7:]


def test_resume_rejects_other_settings():
    lengths, images = _long_tail(64)
    state = BalancedPackingSampler(lengths, images, micro_batch_size=4, num_replicas=2, rank=0).state_dict()
    other = BalancedPackingSampler(lengths, images, micro_batch_size=8, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="micro_batch_size=4 but this sampler has micro_batch_size=8"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="missing 'epoch'"):
        other.load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(ValueError, match="next_micro_batch=99 is outside"):
        BalancedPackingSampler(lengths, images, micro_batch_size=4, num_replicas=2, rank=0).load_state_dict(
            {**state, "next_micro_batch": 99}
        )


def _step_imbalance(loads_per_sample, plan):
    """Sum over steps of the slowest rank's load / sum of the mean rank load (time lost to waiting)."""
    loads = loads_per_sample[plan].sum(axis=-1)
    return loads.max(axis=1).sum() / loads.mean(axis=1).sum()


def _distributed_sampler_plan(n, replicas, micro_batch_size):
    columns = []
    for rank in range(replicas):
        indices = list(DistributedSampler(range(n), num_replicas=replicas, rank=rank, seed=0))
        steps = len(indices) // micro_batch_size
        columns.append(np.array(indices[: steps * micro_batch_size]).reshape(steps, micro_batch_size))
    return np.stack(columns, axis=1)


def test_balances_tokens_and_image_tokens_per_step():
    lengths, images = _long_tail(16_384, seed=1)
    plan = BalancedPackingSampler(lengths, images, micro_batch_size=8, num_replicas=8, rank=0).epoch_plan()
    baseline = _distributed_sampler_plan(16_384, 8, 8)
    ours_tokens, base_tokens = _step_imbalance(lengths, plan), _step_imbalance(lengths, baseline)
    ours_images, base_images = _step_imbalance(images, plan), _step_imbalance(images, baseline)
    assert ours_tokens <= 1.05 < base_tokens, (ours_tokens, base_tokens)
    assert ours_images <= 1.1 and ours_images < base_images / 1.5, (ours_images, base_images)
    # Over the epoch no rank is systematically heavier either.
    totals = lengths[plan].sum(axis=(0, 2))
    assert totals.max() / totals.mean() < 1.02


def test_window_one_balances_inside_each_global_batch_only():
    lengths, images = _long_tail(4096, seed=2)
    baseline = _step_imbalance(lengths, _distributed_sampler_plan(4096, 8, 8))
    options = dict(micro_batch_size=8, num_replicas=8, rank=0, window_steps=1)
    plan = BalancedPackingSampler(lengths, images, **options).epoch_plan()
    assert _step_imbalance(lengths, plan) < baseline
    # Steps keep their random mix: which samples share a step does not depend on the lengths at all.
    flat = np.full(4096, 100)
    same = BalancedPackingSampler(flat, **options).epoch_plan()
    assert {frozenset(step.ravel().tolist()) for step in plan} == {frozenset(step.ravel().tolist()) for step in same}


def test_text_only_data_needs_no_image_counts():
    lengths, _ = _long_tail(512)
    plan = BalancedPackingSampler(lengths, micro_batch_size=4, num_replicas=4, rank=0).epoch_plan()
    assert sorted(plan.ravel().tolist()) == list(range(512))


def test_defaults_without_a_process_group():
    sampler = BalancedPackingSampler([5, 6, 7, 8], micro_batch_size=2)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sorted(i for mb in sampler for i in mb) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([3, -1, 4],), {}, r"token_lengths\[1\] = -1 is negative"),
        (([3, 4], [1]), {}, "image_token_counts has 1 entries but token_lengths has 2"),
        (([[3, 4]],), {}, "non-empty 1-D"),
        (([3.5, 4],), {}, "whole numbers"),
        (([3, 4],), {"rank": 2}, r"rank must be in \[0, num_replicas=2\)"),
        (([3, 4],), {"micro_batch_size": 0}, "micro_batch_size must be an int >= 1"),
        (([3, 4, 5],), {"drop_last": True}, "leaves no micro-batch"),
    ],
)
def test_input_errors(args, kwargs, message):
    options = {"micro_batch_size": 2, "num_replicas": 2, "rank": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        BalancedPackingSampler(*args, **options)


def test_for_trainer_reads_trainer_arguments_and_selects_the_resumed_epoch(tmp_path):
    """``BalancedBatchSampler.for_trainer``: micro-batch, seed and drop_last from TrainingArguments; one resume
    callback however often Trainer rebuilds its dataloader; the epoch of a resumed run from the global step."""
    from types import SimpleNamespace

    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    from vlm_pack.integrations.sampler import BalancedBatchSampler

    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2, data_seed=5,
                             dataloader_drop_last=True, use_cpu=True, report_to="none")
    handler = CallbackHandler([], None, None, None, None)
    trainer = SimpleNamespace(args=args, callback_handler=handler, add_callback=handler.add_callback)
    BalancedBatchSampler.for_trainer(trainer, np.arange(1, 41))
    sampler = BalancedBatchSampler.for_trainer(trainer, np.arange(1, 41))
    assert (sampler.micro_batch_size, sampler.seed, sampler.drop_last, sampler.num_replicas) == (3, 5, True, 1)
    resume = [c for c in handler.callbacks if type(c).__name__ == "_ResumeEpoch"]
    assert len(resume) == 1 and resume[0].sampler is sampler
    # 40 samples // 3 = 13 micro-batches = 7 optimizer steps per epoch (the last one accumulates a single
    # micro-batch): Trainer's own count, read from its set_initial_training_values on this sampler's DataLoader.
    # Steps 12 and 13 tell it from a floored 13 // 2 = 6 (which would resume them in epoch 2).
    loader = DataLoader(range(40), batch_sampler=sampler)
    counter = SimpleNamespace(get_total_train_batch_size=lambda a: 6, get_sp_size=lambda: 1,
                              num_examples=lambda d: 40)
    per_epoch = Trainer.set_initial_training_values(counter, args, loader)[1]
    assert len(loader) == 13 and per_epoch == 7
    for step in (9, 12, 13, 14, 20, 21):
        resume[0].on_train_begin(args, SimpleNamespace(global_step=step), None)
        assert sampler.epoch == step // per_epoch, step
