"""The main job in a reduced mode: both layouts train, and their losses agree step by step."""

from vlm_pack.demo import run_demo


def test_demo_padded_and_packed_losses_agree():
    result = run_demo(steps=2, micro_batch_size=3, seed=1)
    assert len(result.padded) == len(result.packed) == 2
    # identical data, real tokens counted the same way in both layouts
    assert [s.real_tokens for s in result.padded] == [s.real_tokens for s in result.packed]
    assert all(s.padded_slots > 0 for s in result.padded)  # the mix is long-tailed: padding is real
    assert sum(s.padded_slots for s in result.packed) < sum(s.padded_slots for s in result.padded)
    assert result.max_loss_gap < 1e-4
    assert all(s.loss > 0 for s in result.packed)
    table = result.table()
    assert "padding fraction" in table and "loss step 1" in table
