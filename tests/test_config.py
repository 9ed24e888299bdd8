"""Every validation rule has a passing and a failing case; YAML recipes load and validate."""

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from vlm_pack import PackedSequenceSpecs, PackingConfig
from vlm_pack.core.config import check_field_types
from vlm_pack.offline.recipe import DataSpec, ModelSpec, Recipe, TrainSpec, offline_packed_datasets

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


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


# --- strict field types (issue 12.6): a wrong type names the field and the fix, in code and in YAML -------------

@pytest.mark.parametrize(
    ("values", "message"),
    [
        # a quoted boolean is a non-empty string, i.e. truthy: 'False' used to switch in-batch packing ON
        ({"pack_sequences_in_batch": "False"}, r"pack_sequences_in_batch='False' must be true or false, not str; "
                                               r"remove the quotes"),
        ({"sequence_parallel": 1}, r"sequence_parallel=1 must be true or false, not int"),
        ({"tensor_parallel_size": 2.5}, r"tensor_parallel_size=2.5 must be an integer, not float"),
        ({"seq_length": 4096.0}, r"seq_length=4096.0 must be an integer, not float; write 4096"),
        ({"seq_length": "4096"}, r"seq_length='4096' must be an integer, not str; remove the quotes"),
        ({"micro_batch_size": True}, r"micro_batch_size=True must be an integer, not bool"),
        ({"packed_sequence_specs": {"pad_seq_to_mult": 2.5}},
         r"packed_sequence_specs.pad_seq_to_mult=2.5 must be an integer, not float"),
        ({"packed_sequence_specs": {"pad_cu_seqlens": "true"}},
         r"packed_sequence_specs.pad_cu_seqlens='true' must be true or false"),
        ({"packed_sequence_specs": {"packed_train_data_path": 7}},
         r"packed_sequence_specs.packed_train_data_path=7 must be a string or null, not int"),
    ],
)
def test_wrong_types_are_named_in_code_and_in_yaml(tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        PackingConfig.from_dict(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"packing": values}))
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        PackingConfig.from_yaml(path)
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        Recipe.from_yaml(path)


def test_wrong_types_in_the_constructor():
    with pytest.raises(ValueError, match=r"^pack_sequences_in_batch='False' must be true or false"):
        PackingConfig(pack_sequences_in_batch="False", micro_batch_size=1)
    with pytest.raises(ValueError, match=r"^packed_sequence_specs.packed_sequence_size=2.5 must be an integer"):
        PackedSequenceSpecs(packed_sequence_size=2.5)
    with pytest.raises(ValueError, match=r"packed_sequence_specs=\{.*\} must be a PackedSequenceSpecs.*from_dict"):
        PackingConfig(packed_sequence_specs={"packed_sequence_size": 8})
    with pytest.raises(ValueError, match=r"^train.steps='10' must be an integer"):
        TrainSpec(steps="10")
    with pytest.raises(ValueError, match=r"^train.lr='1e-3' must be a number"):
        TrainSpec(lr="1e-3")  # YAML 1.1 reads 1e-3 (no dot) as a string: the classic trap


def test_accepted_equivalents_are_normalised():
    config = PackingConfig(seq_length=np.int64(8), micro_batch_size=2, global_batch_size=4)
    assert type(config.seq_length) is int and config.seq_length == 8
    assert TrainSpec(lr=1).lr == 1.0 and type(TrainSpec(lr=1).lr) is float
    specs = PackedSequenceSpecs(packed_sequence_size=8, packed_metadata_path=Path("a/8_metadata.jsonl"))
    assert specs.packed_metadata_path == "a/8_metadata.jsonl"


def test_non_mapping_sections_are_named(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(ValueError, match=r"section 'train' must be a mapping"):
        Recipe.from_yaml(path)
    with pytest.raises(ValueError, match=r"packing.packed_sequence_specs must be a mapping"):
        PackingConfig.from_dict({"packed_sequence_specs": [1024]})


# --- packed-data paths (issue 11.6): validated, and what the dataset builder opens -----------------------------

@pytest.fixture(scope="module")
def prepared(aligned_packs):
    """Training, validation and metadata paths (str) of packs prepared at size 128, samples aligned to 4."""
    return tuple(str(aligned_packs[key]) for key in ("training", "validation", "metadata"))


def offline_config(**paths):
    return PackingConfig(seq_length=128, micro_batch_size=1, packed_sequence_specs=PackedSequenceSpecs(
        packed_sequence_size=128, pad_to_max_length=True, pad_cu_seqlens=True, pad_seq_to_mult=4, **paths))


def test_packed_paths_are_validated(prepared, tmp_path):
    train, val, meta = prepared
    offline_config(packed_train_data_path=train, packed_val_data_path=val, packed_metadata_path=meta).validate()
    cases = [
        (dict(packed_train_data_path=str(tmp_path / "training_128.npy")), "packed_train_data_path=.*does not exist"),
        (dict(packed_val_data_path=meta), r"packed_val_data_path=.*must name a \.npy file"),
        (dict(packed_metadata_path=train), r"packed_metadata_path=.*must name a \.jsonl file"),
        (dict(packed_metadata_path=str(tmp_path / "128_metadata.jsonl")), "packed_metadata_path=.*does not exist"),
    ]
    for paths, message in cases:
        with pytest.raises(ValueError, match=message):
            offline_config(**paths).validate()
    with pytest.raises(ValueError, match="packed_train_data_path=.*switches offline packing off"):
        PackingConfig(packed_sequence_specs=PackedSequenceSpecs(packed_train_data_path=train)).validate()


def test_dataset_builder_opens_the_configured_paths(prepared):
    from vlm_pack.offline import PackedSFTDataset

    train, val, meta = prepared
    config = offline_config(packed_train_data_path=train, packed_val_data_path=val, packed_metadata_path=meta)
    training, validation = offline_packed_datasets(config)
    assert str(training.path) == train and str(validation.path) == val
    direct = PackedSFTDataset(val, 128, metadata=meta, pad_to_max_length=True, pad_cu_seqlens=True, pad_seq_to_mult=4)
    assert len(validation) == len(direct) and len(training) > 0
    batch, expected = validation.collate_fn([validation[0]]), direct.collate_fn([direct[0]])
    assert batch["input_ids"].shape == (1, 128)  # pad_to_max_length honoured
    assert "cu_seqlens_unpadded" in batch["vlm_pack"]  # pad_seq_to_mult honoured
    assert batch["vlm_pack"]["cu_seqlens"].shape[-1] == direct.cu_seqlens_entries  # pad_cu_seqlens + metadata
    assert all(torch.equal(batch[key], expected[key]) for key in ("input_ids", "labels", "cu_seq_lens_q"))
    train_only, none = offline_packed_datasets(offline_config(packed_train_data_path=train, packed_metadata_path=meta))
    assert none is None and len(train_only) == len(training)
    with pytest.raises(ValueError, match="need packed_sequence_specs.packed_sequence_size > 0 and packed_train"):
        offline_packed_datasets(offline_config(packed_metadata_path=meta))


# --- every key of a shipped recipe is read by its example (issue 11.6: a key nothing reads is a defect) -------

SECTIONS = {ModelSpec: "model", DataSpec: "data", TrainSpec: "train", PackingConfig: "packing",
            PackedSequenceSpecs: "packing.packed_sequence_specs"}
EXAMPLES = {"qwen2vl_in_batch_packing.yaml": "finetune_vlm_packed",
            "llm_offline_packing.yaml": "finetune_llm_offline_packed"}


def yaml_keys(mapping, prefix=""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from yaml_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def keys_the_example_reads(monkeypatch, example: str, argv: list[str]) -> set[str]:
    """Run ``example`` (training replaced by a no-op) and record which recipe fields it reads after loading.

    Reads made while validating or type-checking do not count: a key only validation looks at configures nothing.
    """
    ignored = {PackingConfig.validate.__code__, check_field_types.__code__}
    reads: set[str] = set()

    def recorder(section):
        def __getattribute__(self, name):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code not in ignored:
                frame = frame.f_back
            if frame is None:
                reads.add(f"{section}.{name}")
            return object.__getattribute__(self, name)
        return __getattribute__

    load = Recipe.from_yaml

    def load_then_record(path):
        recipe = load(path)
        for cls, section in SECTIONS.items():
            monkeypatch.setattr(cls, "__getattribute__", recorder(section), raising=False)
        return recipe

    monkeypatch.setattr(Recipe, "from_yaml", staticmethod(load_then_record))
    spec = importlib.util.spec_from_file_location(example, ROOT / "examples" / f"{example}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "train", lambda model, batches, optimizer, steps, **kwargs: [1.0] * steps)
    module.main(argv)
    monkeypatch.undo()
    return reads


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_yaml_key_is_read_by_its_example(monkeypatch, tmp_path, name):
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXAMPLES)  # a new recipe needs an entry here
    raw = yaml.safe_load((CONFIGS / name).read_text())
    keys = set(yaml_keys(raw))
    # plant one key this example does not use: the walk must report it, and nothing else
    planted = "packing.seq_length" if "offline" in name else "packing.global_batch_size"
    section, key = planted.split(".")
    assert planted not in keys
    raw[section][key] = 1024 if key == "seq_length" else 32
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    argv = ["--config", str(path)] + (["--prepared-root", str(tmp_path)] if "offline" in name else [])
    assert (keys | {planted}) - keys_the_example_reads(monkeypatch, EXAMPLES[name], argv) == {planted}


@pytest.mark.parametrize(("text", "match"), [
    ("packing:\n  seq_length: 1024\n  seq_length: 2048\n", r"line 3: invalid YAML \(duplicate key 'seq_length'"),
    ("packing:\n  seq_length: [1024\n", r"line \d+: invalid YAML"),
    ("packing: !!python/object/apply:os.system ['true']\n", r"line 1: invalid YAML"),
])
def test_yaml_duplicates_syntax_errors_and_unsafe_tags_are_one_line(tmp_path, text, match):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    for load in (PackingConfig.from_yaml, Recipe.from_yaml):
        with pytest.raises(ValueError, match=re.escape(str(path)) + ", " + match) as info:
            load(path)
        assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("name", ["../x", "/abs/path", "a/b", "..", ""])
def test_tokenizer_model_name_cannot_leave_the_output_folder(name):
    with pytest.raises(ValueError, match=r"packed_sequence_specs.tokenizer_model_name=.* must be a plain folder name"):
        PackingConfig.from_dict({"packed_sequence_specs": {"tokenizer_model_name": name}})
