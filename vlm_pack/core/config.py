"""Typed packing configuration, loadable from YAML, with validation that names the field and the fix."""

from __future__ import annotations

import dataclasses
import numbers
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .output_name import check_output_name
from .packing import pad_multiple

__all__ = ["PackedSequenceSpecs", "PackingConfig", "check_field_types", "load_yaml_section", "reject_unknown_keys"]


@dataclass
class PackedSequenceSpecs:
    """Offline packing: where packs live on disk and how they are collated.

    ``packed_sequence_size > 0`` switches offline packing on (then micro-batch size must be 1).
    ``pad_cu_seqlens`` gives every batch the same ``cu_seqlens`` shape for CUDA graphs and needs
    ``pad_to_max_length``. ``pad_seq_to_mult`` aligns each sequence inside a pack (context parallelism).
    ``packed_train_data_path`` / ``packed_val_data_path`` (``training_<size>.npy`` / ``validation_<size>.npy``) and
    ``packed_metadata_path`` (``<size>_metadata.jsonl``) name what ``vlm-pack prepare`` wrote; they must exist
    when set, and :func:`vlm_pack.offline.recipe.offline_packed_datasets` opens them. ``tokenizer_model_name`` names the
    ``packed/<tokenizer_model_name>/`` folder packs are prepared into (default: the tokenizer's folder name).
    """

    packed_sequence_size: int = -1
    tokenizer_model_name: str | None = None
    packed_train_data_path: str | None = None
    packed_val_data_path: str | None = None
    packed_metadata_path: str | None = None
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    pad_seq_to_mult: int = 1

    def __post_init__(self) -> None:
        check_field_types(self, "packed_sequence_specs.")
        if self.tokenizer_model_name is not None:
            check_output_name(self.tokenizer_model_name, "packed_sequence_specs.tokenizer_model_name")

    @property
    def enabled(self) -> bool:
        return self.packed_sequence_size > 0


@dataclass
class PackingConfig:
    """How micro-batches are packed and split across parallel ranks.

    ``pack_sequences_in_batch`` packs each micro-batch (size >= 2) into one row at collate time; offline packing
    (``packed_sequence_specs``) serves pre-built packs with micro-batch size 1. The two are exclusive.
    """

    seq_length: int = 4096
    micro_batch_size: int = 2
    global_batch_size: int = 32
    pack_sequences_in_batch: bool = False
    context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    finetuning: bool = True
    calculate_per_token_loss: bool = False
    average_in_collective: bool = True
    packed_sequence_specs: PackedSequenceSpecs = field(default_factory=PackedSequenceSpecs)

    def __post_init__(self) -> None:
        check_field_types(self)

    @property
    def pad_to_multiple_of(self) -> int:
        """Per-sequence alignment implied by the parallel layout (see :func:`vlm_pack.pad_multiple`)."""
        return pad_multiple(self.context_parallel_size, self.tensor_parallel_size, self.sequence_parallel)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "PackingConfig":
        """Build from a plain mapping; unknown keys are errors (a typo must not silently disable packing)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"packing must be a mapping of keys, got {type(values).__name__} {values!r:.60}")
        values = dict(values)
        specs = values.pop("packed_sequence_specs", None)
        specs = {} if specs is None else specs
        if not isinstance(specs, Mapping):
            raise ValueError(f"packing.packed_sequence_specs must be a mapping of keys, got {type(specs).__name__}")
        reject_unknown_keys(cls, values, "packing")
        reject_unknown_keys(PackedSequenceSpecs, specs, "packing.packed_sequence_specs")
        return cls(**values, packed_sequence_specs=PackedSequenceSpecs(**specs))

    @classmethod
    def from_yaml(cls, path: str | Path, section: str = "packing") -> "PackingConfig":
        """Load the ``section`` mapping of a YAML recipe (the whole file when it has no such key) and validate."""
        try:
            return cls.from_dict(load_yaml_section(path, section)).validate()
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def validate(self) -> "PackingConfig":
        """Enforce the packing rules; raise ``ValueError`` naming the field, its value and the fix."""
        specs = self.packed_sequence_specs
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "context_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if specs.pad_seq_to_mult < 1:
            raise ValueError(f"packed_sequence_specs.pad_seq_to_mult={specs.pad_seq_to_mult} must be >= 1")
        if self.pack_sequences_in_batch and specs.enabled:
            raise ValueError(
                "pack_sequences_in_batch=True and packed_sequence_specs.packed_sequence_size="
                f"{specs.packed_sequence_size} are mutually exclusive: choose in-batch packing (set "
                "packed_sequence_size=-1) or offline packing (set pack_sequences_in_batch=False)"
            )
        if specs.enabled and self.micro_batch_size != 1:
            raise ValueError(
                f"offline packing (packed_sequence_size={specs.packed_sequence_size}) needs micro_batch_size=1, got "
                f"{self.micro_batch_size}: a pack already holds several samples; set micro_batch_size=1 and divide "
                "global_batch_size by the packing factor from the pack metadata"
            )
        if self.pack_sequences_in_batch and self.micro_batch_size < 2:
            raise ValueError(
                f"pack_sequences_in_batch=True needs micro_batch_size >= 2, got {self.micro_batch_size}: there is "
                "nothing to pack in a batch of one; raise micro_batch_size or use offline packing"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size="
                f"{self.micro_batch_size}; pick sizes that divide"
            )
        cp = self.context_parallel_size
        if cp > 1:
            if self.seq_length % (2 * cp):
                raise ValueError(
                    f"seq_length={self.seq_length} must be divisible by 2*context_parallel_size={2 * cp} "
                    "(zigzag context parallelism cuts each sequence into 2*cp chunks); round seq_length up"
                )
            if self.finetuning and (not self.calculate_per_token_loss or self.average_in_collective):
                raise ValueError(
                    f"finetuning with context_parallel_size={cp} needs calculate_per_token_loss=True and "
                    f"average_in_collective=False (got {self.calculate_per_token_loss}, {self.average_in_collective}): "
                    "a rank whose tokens are all masked would otherwise divide by zero and yield NaN"
                )
        if self.seq_length % self.pad_to_multiple_of:
            raise ValueError(
                f"seq_length={self.seq_length} must be a multiple of {self.pad_to_multiple_of} (the per-sequence "
                f"alignment for cp={cp}, tp={self.tensor_parallel_size}, sequence_parallel={self.sequence_parallel})"
            )
        for name, suffix in _PACKED_PATH_SUFFIXES.items():
            _check_packed_path(specs, name, suffix)
        if specs.pad_cu_seqlens and not specs.pad_to_max_length:
            raise ValueError(
                "packed_sequence_specs.pad_cu_seqlens=True needs pad_to_max_length=True: fixed-shape cu_seqlens "
                "for CUDA graphs only make sense when every pack has the same length"
            )
        if specs.enabled and specs.packed_sequence_size > self.seq_length:
            raise ValueError(
                f"packed_sequence_size={specs.packed_sequence_size} exceeds seq_length={self.seq_length}; "
                "a pack longer than the model's sequence length would be cut. Lower packed_sequence_size"
            )
        if specs.enabled and specs.packed_sequence_size % self.pad_to_multiple_of:
            raise ValueError(
                f"packed_sequence_size={specs.packed_sequence_size} must be a multiple of {self.pad_to_multiple_of} "
                "(the alignment that context/sequence parallelism needs)"
            )
        return self


# The files `vlm-pack prepare` writes, by the spec field that points at them.
_PACKED_PATH_SUFFIXES = {"packed_train_data_path": ".npy", "packed_val_data_path": ".npy", "packed_metadata_path": ".jsonl"}


def _check_packed_path(specs: PackedSequenceSpecs, name: str, suffix: str) -> None:
    """A packed-data path, when set, must belong to offline packing, end in ``suffix`` and exist."""
    value = getattr(specs, name)
    if value is None:
        return
    where = f"packed_sequence_specs.{name}={value!r}"
    if not specs.enabled:
        raise ValueError(
            f"{where} is set but packed_sequence_size={specs.packed_sequence_size} switches offline packing off; set "
            "packed_sequence_size to the pack size the data was prepared with, or remove the path"
        )
    if not value.endswith(suffix):
        raise ValueError(f"{where} must name a {suffix} file written by `vlm-pack prepare`")
    if not Path(value).is_file():
        raise ValueError(f"{where} does not exist; run `vlm-pack prepare` first or fix the path")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (each key may appear once; remove one)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content (safe tags only, no duplicate keys); every problem one ValueError naming the file and
    line."""
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: invalid YAML ({problem}); fix the file (only plain YAML: no Python tags)") from None


def load_yaml_section(path: str | Path, section: str) -> dict[str, Any]:
    """Read one top-level mapping from a YAML recipe (or the whole file when ``section`` is absent)."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at top level, got {type(data).__name__}")
    value = data.get(section, data)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: '{section}' must be a mapping, got {type(value).__name__}")
    return value


def reject_unknown_keys(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Raise naming the unknown keys of ``values`` for dataclass ``cls`` (a typo must never pass silently)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in '{where}'; known keys: {sorted(known)}")


# What each annotated type accepts, and how an error names it. bool is not an int here: YAML's `1` for a flag and
# `true` for a size are both mistakes.
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def check_field_types(obj: Any, prefix: str = "") -> None:
    """Check every field of dataclass ``obj`` against its annotation; raise ``ValueError`` naming the field.

    Strict on purpose: ``'False'`` (a quoted YAML boolean) is not a bool (it would be truthy), ``2.5`` is not an
    int, ``'4096'`` is not an int. Integral numpy scalars are accepted as int and path-likes as str (both are
    normalised in place); an int is accepted where a float is expected.
    """
    hints = typing.get_type_hints(type(obj))
    for item in dataclasses.fields(obj):
        value = getattr(obj, item.name)
        allowed = typing.get_args(hints[item.name]) or (hints[item.name],)
        normalised = _normalise(value, allowed)
        if normalised is _MISMATCH:
            expected = " or ".join(_TYPE_NAMES.get(kind, f"a {kind.__name__}") for kind in allowed)
            hint = "; remove the quotes" if isinstance(value, str) else ""
            if isinstance(value, float) and int in allowed and value.is_integer():
                hint = f"; write {int(value)}"
            if any(dataclasses.is_dataclass(kind) for kind in allowed):
                hint = "; build it from a mapping with PackingConfig.from_dict / from_yaml"
            raise ValueError(
                f"{prefix}{item.name}={value!r} must be {expected}, not {type(value).__name__}{hint}"
            )
        if normalised is not value:
            object.__setattr__(obj, item.name, normalised)


_MISMATCH = object()


def _normalise(value: Any, allowed: tuple[type, ...]) -> Any:
    """``value`` (possibly converted to the annotated type) if it is one of ``allowed``, else ``_MISMATCH``."""
    if isinstance(value, bool):
        return value if bool in allowed else _MISMATCH
    if isinstance(value, numbers.Integral) and (int in allowed or float in allowed):
        return int(value) if int in allowed else float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and float in allowed:
        return float(value)
    if isinstance(value, os.PathLike) and str in allowed:
        return os.fspath(value)
    for kind in allowed:
        if kind not in (bool, int, float) and isinstance(value, kind):
            return value
    return _MISMATCH
