"""The token-mean guard (``vlm_pack.integrations.token_mean``) on a real 2-process gloo group (forked: no imports).

With ``average_tokens_across_devices=False`` each rank passes its OWN window's label count as ``num_items_in_batch``.
Those counts differ between ranks in general, but are equal whenever the ranks happen to hold as many targets
(fixed-length data, or a balanced sampler): the guard must still see that the count is below the targets of both
ranks together. The global count (the default) stays silent.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from vlm_pack.integrations import token_mean


def _rank(rank: int, store: str, count: int, targets: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        token_mean._checked = False
        labels = torch.full((1, 12), -100)
        labels[0, 1:1 + targets] = 7  # the first slot is never a target (the loss shifts)
        results.put((rank, token_mean.check_global_token_count(count, labels)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("counts", "targets", "warns"), [
    ((8, 8), (3, 5), False),  # the global count: 3 + 5 on both ranks
    ((3, 5), (3, 5), True),   # per-rank counts that differ
    ((4, 4), (4, 4), True),   # per-rank counts that happen to be equal: only the sum over ranks tells
])
def test_guard_warns_for_a_per_rank_count(tmp_path, counts, targets, warns):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), counts[r], targets[r], results))
             for r in range(2)]
    for process in ranks:
        process.start()
    try:
        got = dict(results.get(timeout=60) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    assert got == {0: warns, 1: warns}
