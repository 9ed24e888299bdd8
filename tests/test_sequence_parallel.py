"""vlm_pack.sequence_parallel in one process: the Ulysses batch, the slice hooks, and every setup refusal.

The 2-process runs (exact against each sample alone, corruptions) are in tests/test_multiprocess.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlm_pack.core.versions import has
from vlm_pack.models import UnsupportedVersionError
from vlm_pack.sequence_parallel import UlyssesCollator, grouped_rows, prepare_model, ulysses_batch
from vlm_pack.sequence_parallel.batch import SP_KEY
from vlm_pack.sequence_parallel.model import SP_ATTN_IMPLEMENTATION, SequenceShard
from vlm_pack.sequence_parallel.trainer import check_ulysses_arguments
from vlm_pack.testing.tiny_models import tiny_model


def packed_row(lengths=(5, 3, 4)) -> dict:
    """A packed row as the collators give it (PackedDataset.collate's keys): samples of 5, 3 and 4 tokens."""
    ids = torch.arange(10, 10 + sum(lengths))[None]
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": 5, "max_length_k": 5, "vlm_pack": {"seq_lengths": torch.tensor(lengths)}}


def test_row_is_padded_with_one_fill_segment_and_sliceable_tensors_only():
    batch = packed_row()  # 12 tokens
    out = ulysses_batch(batch, 5)
    row = out[SP_KEY]
    assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (1, 15)
    assert [k for k, v in out.items() if isinstance(v, torch.Tensor)] == ["input_ids", "labels", "position_ids"]
    assert row["cu_seq_lens_q"].tolist() == [0, 5, 8, 12, 15] and row["max_length_q"] == 5
    assert out["labels"][0, 12:].tolist() == [-100] * 3
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert "labels" not in row and "vlm_pack" not in row
    assert ulysses_batch(batch, 4)[SP_KEY]["cu_seq_lens_q"].tolist() == [0, 5, 8, 12]  # already a multiple
    assert ulysses_batch(batch, 2, pad_to_length=20)["input_ids"].shape == (1, 20)


def test_mrope_positions_are_padded_on_every_channel():
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long),
             "position_ids": torch.arange(3).expand(4, 1, 3), "cu_seq_lens_q": torch.tensor([0, 3]),
             "max_length_q": 3, "pixel_values": torch.zeros(8, 3)}
    row = ulysses_batch(batch, 2)[SP_KEY]
    assert row["position_ids"].shape == (4, 1, 4) and row["pixel_values"].shape == (8, 3)


def test_refuses_what_cannot_be_split():
    batch = packed_row()
    with pytest.raises(ValueError, match="ONE packed row"):
        ulysses_batch({"input_ids": torch.ones(2, 4, dtype=torch.long)}, 2)
    with pytest.raises(ValueError, match="longer than pad_to_length"):
        ulysses_batch(batch, 2, pad_to_length=10)
    with pytest.raises(ValueError, match="multiple of sp_size"):
        ulysses_batch(batch, 2, pad_to_length=13)


def test_grouped_rows_pack_several_examples_per_micro_batch():
    rows = grouped_rows(list(range(7)), 3)
    assert len(rows) == 3 and rows[2] == [6]
    seen = []
    collator = UlyssesCollator(lambda items: seen.append(items) or packed_row(), 2)
    collator([rows[0]])
    assert seen == [[0, 1, 2]]


def test_slice_hook_gives_the_language_model_its_part_of_the_row():
    """prepare_model's hooks on a real Llama, with a fixed shard (no process group): the decoder sees rank 1's
    half of input_ids and positions, the row's boundaries untouched (the Ulysses wrapper, absent here, gives the
    attention the whole row)."""
    model = prepare_model(tiny_model("llama", layers=1), 2, shard_of=lambda: SequenceShard(1, 2))
    seen = {}

    class Seen(Exception):
        pass

    def capture(module, args, kwargs):
        seen.update(kwargs)
        raise Seen

    model.model.register_forward_pre_hook(capture, with_kwargs=True)
    batch = ulysses_batch(packed_row(), 2)
    with pytest.raises(Seen):
        model(input_ids=batch["input_ids"][:, :6], position_ids=batch["position_ids"][:, :6], **{SP_KEY: batch[SP_KEY]})
    assert model.config._attn_implementation == SP_ATTN_IMPLEMENTATION
    assert seen["input_ids"].tolist() == batch[SP_KEY]["input_ids"][:, 6:].tolist()
    assert seen["position_ids"].tolist() == [[1, 2, 0, 1, 2, 3]]
    assert seen["cu_seq_lens_q"].tolist() == [0, 5, 8, 12]
    with pytest.raises(ValueError, match="UlyssesTrainer"):  # stock Trainer's per-row mean loss
        model(input_ids=batch["input_ids"][:, :6], labels=batch["labels"][:, :6], **{SP_KEY: batch[SP_KEY]})


def test_vision_tower_keeps_its_own_attention_name():
    model = prepare_model(tiny_model("qwen2_vl", layers=1), 2)
    assert model.config.text_config._attn_implementation == SP_ATTN_IMPLEMENTATION
    assert model.config.vision_config._attn_implementation == "vlm_pack_varlen"


def test_prepare_model_refusals():
    if not has("ulysses_trainer"):  # refused before anything else, naming the release
        with pytest.raises(UnsupportedVersionError, match=r"transformers>=5\.24"):
            prepare_model(tiny_model("llama", layers=1), 2)
        return
    with pytest.raises(ValueError, match="heads"):
        prepare_model(tiny_model("llama", layers=1), 8)
    with pytest.raises(ValueError, match="linear-attention"):
        prepare_model(tiny_model("qwen3_5", layers=2), 2)
    with pytest.raises(ValueError, match="image blocks"):
        prepare_model(tiny_model("gemma3", layers=1), 2)
    with pytest.raises(ValueError, match="image blocks"):
        prepare_model(tiny_model("gemma4", layers=1), 2)


def arguments(**overrides) -> SimpleNamespace:
    handler = SimpleNamespace(sp_attn_implementation=SP_ATTN_IMPLEMENTATION)
    pc = SimpleNamespace(sp_size=2, cp_size=1, sp_backend="deepspeed", sp_handler=handler)
    base = {"parallelism_config": pc, "deepspeed": {"zero_optimization": {"stage": 3}},
            "per_device_train_batch_size": 1}
    return SimpleNamespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def prepared():
    return prepare_model(tiny_model("llama", layers=1), 2)


def test_setup_refusals(prepared):
    check_ulysses_arguments(arguments(), prepared)  # the recipe passes
    cases = {
        # a DeepSpeed config without a zero_optimization section is stage 0 (DeepSpeed's default)
        "ZeRO stage 0 under sequence parallelism is refused": arguments(deepspeed={"gradient_clipping": 1.0}),
        "ring attention": arguments(parallelism_config=SimpleNamespace(cp_size=2, sp_size=1)),
        "parallelism_config=ParallelismConfig": arguments(parallelism_config=None),
        "ignores packed boundaries": arguments(parallelism_config=SimpleNamespace(
            sp_size=2, cp_size=1, sp_backend="deepspeed", sp_handler=SimpleNamespace(sp_attn_implementation="sdpa"))),
        "deepspeedai/DeepSpeed#5248": arguments(deepspeed={"zero_optimization": {"stage": 2}}),
        "runs inside DeepSpeed": arguments(deepspeed=None),
        "ONE packed row": arguments(per_device_train_batch_size=2),
        "evaluation": arguments(eval_strategy="steps"),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            check_ulysses_arguments(args, prepared)
    with pytest.raises(ValueError, match="not prepared"):
        check_ulysses_arguments(arguments(), tiny_model("llama", layers=1))
