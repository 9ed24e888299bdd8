"""The main job in a reduced mode: three layouts train interleaved, and their losses agree step by step."""

import pytest

from vlm_pack.cli.demo import LAYOUTS, DemoResult, StepRecord, run_demo


def test_demo_layouts_losses_agree():
    result = run_demo(steps=2, micro_batch_size=2, seed=1, progress=False)
    assert set(result.steps) == set(LAYOUTS) and all(len(r) == 2 for r in result.steps.values())
    # identical data, real tokens counted the same way in every layout
    reals = {name: [s.real_tokens for s in records] for name, records in result.steps.items()}
    assert reals["padded + mask"] == reals["padded, causal"] == reals["packed"]
    assert all(s.padded_slots > 0 for s in result.padded)  # the mix is long-tailed: padding is real
    assert sum(s.slots for s in result.packed) < sum(s.slots for s in result.padded)
    assert result.max_loss_gap < 1e-4  # the causal, mask-free padded baseline is exact too
    assert all(s.loss > 0 for s in result.packed)
    table = result.table()
    assert "padding fraction" in table and "loss step 1" in table and "ideal" in table


def test_speedup_is_the_median_of_paired_warm_steps_and_ideal_is_slot_ratio():
    def steps(seconds, slots):
        return [StepRecord(1.0, s, 100, slots - 100) for s in seconds]

    result = DemoResult({
        "padded + mask": steps([9.0, 4.0, 6.0, 2.0], 300),
        "padded, causal": steps([9.0, 3.0, 3.0, 3.0], 300),
        "packed": steps([1.0, 2.0, 2.0, 1.0], 120),
    }, samples_per_step=3)
    # step 0 (warm-up) left out; ratios 2, 3, 2 -> median 2, range 2-3
    assert result.speedup("padded + mask") == (2.0, 2.0, 3.0)
    assert result.speedup("padded, causal") == (1.5, 1.5, 3.0)
    assert result.ideal("padded + mask") == pytest.approx(2.5)
    assert "1.50x median of 3 paired steps (range 1.50-3.00x); ideal 2.50x" in result.table()
