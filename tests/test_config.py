"""Every validation rule has a passing and a failing case; YAML recipes load and validate."""

from pathlib import Path

import pytest

from vlm_pack import PackedSequenceSpecs, PackingConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def offline(size=4096, **spec_kwargs):
    return PackedSequenceSpecs(packed_sequence_size=size, **spec_kwargs)


@pytest.mark.parametrize(
    "good,bad,match",
    [
        # offline packing needs micro_batch_size == 1
        (dict(micro_batch_size=1, packed_sequence_specs=offline()),
         dict(micro_batch_size=2, packed_sequence_specs=offline()), "micro_batch_size=1"),
        # in-batch packing needs micro_batch_size > 1
        (dict(micro_batch_size=2, pack_sequences_in_batch=True),
         dict(micro_batch_size=1, pack_sequences_in_batch=True), "micro_batch_size >= 2"),
        # the two are mutually exclusive
        (dict(micro_batch_size=1, packed_sequence_specs=offline()),
         dict(micro_batch_size=1, pack_sequences_in_batch=True, packed_sequence_specs=offline()), "mutually exclusive"),
        # cp > 1 needs seq_length % (2*cp) == 0
        (dict(seq_length=4096, context_parallel_size=4, calculate_per_token_loss=True, average_in_collective=False),
         dict(seq_length=4100, context_parallel_size=4, calculate_per_token_loss=True, average_in_collective=False),
         "divisible by 2\\*context_parallel_size=8"),
        # finetuning with cp > 1 needs per-token loss ...
        (dict(context_parallel_size=2, calculate_per_token_loss=True, average_in_collective=False),
         dict(context_parallel_size=2, calculate_per_token_loss=False, average_in_collective=False), "NaN"),
        # ... and no averaging in the collective
        (dict(context_parallel_size=2, calculate_per_token_loss=True, average_in_collective=False),
         dict(context_parallel_size=2, calculate_per_token_loss=True, average_in_collective=True), "average_in_collective=False"),
        # pad_cu_seqlens requires pad_to_max_length
        (dict(micro_batch_size=1, packed_sequence_specs=offline(pad_cu_seqlens=True, pad_to_max_length=True)),
         dict(micro_batch_size=1, packed_sequence_specs=offline(pad_cu_seqlens=True)), "pad_to_max_length=True"),
        # a pack longer than seq_length would be cut
        (dict(seq_length=4096, micro_batch_size=1, packed_sequence_specs=offline(4096)),
         dict(seq_length=2048, micro_batch_size=1, packed_sequence_specs=offline(4096)), "exceeds seq_length"),
        # sequence parallel alignment: seq_length multiple of cp*tp
        (dict(seq_length=4096, tensor_parallel_size=8, sequence_parallel=True),
         dict(seq_length=4100, tensor_parallel_size=8, sequence_parallel=True), "multiple of 8"),
        # global batch divides into micro-batches
        (dict(micro_batch_size=4, global_batch_size=32), dict(micro_batch_size=3, global_batch_size=32), "not a multiple"),
        # sizes are positive
        (dict(context_parallel_size=1), dict(context_parallel_size=0), "context_parallel_size=0"),
    ],
)
def test_rule_pass_and_fail(good, bad, match):
    PackingConfig(**good).validate()
    with pytest.raises(ValueError, match=match):
        PackingConfig(**bad).validate()


def test_pad_to_multiple_of_follows_parallel_layout():
    assert PackingConfig(context_parallel_size=2, tensor_parallel_size=4, sequence_parallel=True).pad_to_multiple_of == 8
    assert PackingConfig().pad_to_multiple_of == 1


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="pack_sequence_in_batch"):
        PackingConfig.from_dict({"pack_sequence_in_batch": True})
    with pytest.raises(ValueError, match="packed_sequence_specs"):
        PackingConfig.from_dict({"packed_sequence_specs": {"packed_size": 4}})


def test_yaml_roundtrip(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("packing:\n  pack_sequences_in_batch: true\n  micro_batch_size: 4\n  context_parallel_size: 2\n"
                    "  calculate_per_token_loss: true\n  average_in_collective: false\n")
    cfg = PackingConfig.from_yaml(path)
    assert cfg.pack_sequences_in_batch and cfg.micro_batch_size == 4 and cfg.pad_to_multiple_of == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("packing:\n  pack_sequences_in_batch: true\n  micro_batch_size: 1\n")
    with pytest.raises(ValueError, match="micro_batch_size >= 2"):
        PackingConfig.from_yaml(bad)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    PackingConfig.from_yaml(path)
