"""Typed packing configuration, loadable from YAML, with validation that names the field and the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .packing import pad_multiple

__all__ = ["PackedSequenceSpecs", "PackingConfig", "load_yaml_section", "reject_unknown_keys"]


@dataclass
class PackedSequenceSpecs:
    """Offline packing: where packs live on disk and how they are collated.

    ``packed_sequence_size > 0`` switches offline packing on (then micro-batch size must be 1).
    ``pad_cu_seqlens`` gives every batch the same ``cu_seqlens`` shape for CUDA graphs and needs
    ``pad_to_max_length``. ``pad_seq_to_mult`` aligns each sequence inside a pack (context parallelism).
    """

    packed_sequence_size: int = -1
    tokenizer_model_name: str | None = None
    packed_train_data_path: str | None = None
    packed_val_data_path: str | None = None
    packed_metadata_path: str | None = None
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    pad_seq_to_mult: int = 1

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

    @property
    def pad_to_multiple_of(self) -> int:
        """Per-sequence alignment implied by the parallel layout (see :func:`vlm_pack.pad_multiple`)."""
        return pad_multiple(self.context_parallel_size, self.tensor_parallel_size, self.sequence_parallel)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "PackingConfig":
        """Build from a plain mapping; unknown keys are errors (a typo must not silently disable packing)."""
        values = dict(values)
        specs = values.pop("packed_sequence_specs", None) or {}
        reject_unknown_keys(cls, values, "packing")
        reject_unknown_keys(PackedSequenceSpecs, specs, "packing.packed_sequence_specs")
        return cls(**values, packed_sequence_specs=PackedSequenceSpecs(**specs))

    @classmethod
    def from_yaml(cls, path: str | Path, section: str = "packing") -> "PackingConfig":
        """Load the ``section`` mapping of a YAML recipe (the whole file when it has no such key) and validate."""
        config = cls.from_dict(load_yaml_section(path, section))
        config.validate()
        return config

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


def load_yaml_section(path: str | Path, section: str) -> dict[str, Any]:
    """Read one top-level mapping from a YAML recipe (or the whole file when ``section`` is absent)."""
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
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
