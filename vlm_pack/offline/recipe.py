"""Fine-tuning recipes from YAML: model, data, training loop settings and the packing config, all typed.

A recipe file has four sections; ``packing`` is a :class:`~vlm_pack.core.config.PackingConfig`::

    model:    {family: qwen2_vl, checkpoint: null}      # tiny random model, or a local HF checkpoint path
    data:     {source: demo_mix, num_samples: 48}       # or a JSONL path (chat "messages" / prompt+response)
    train:    {steps: 20, lr: 1.0e-3, loss_reduction: token}
    packing:  {pack_sequences_in_batch: true, micro_batch_size: 4, ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..core.config import PackingConfig, check_field_types, read_yaml, reject_unknown_keys
from .dataset import PackedSFTDataset

__all__ = ["DataSpec", "ModelSpec", "Recipe", "TrainSpec", "offline_packed_datasets"]


@dataclass
class ModelSpec:
    """``checkpoint``: a local Hugging Face model directory; without one a tiny random ``family`` model is built."""

    family: str = "qwen2_vl"
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "model.")


@dataclass
class DataSpec:
    """``source``: ``demo_mix`` (shipped photos, VQA pairs and chats) or a JSONL path; ``prepared_root`` is
    where offline packs are written/read."""

    source: str = "demo_mix"
    num_samples: int = 48
    prompt_field: str = "prompt"
    response_field: str = "response"
    prepared_root: str = "runs/prepared"
    algorithm: str = "best_fit_decreasing"

    def __post_init__(self) -> None:
        check_field_types(self, "data.")


@dataclass
class TrainSpec:
    steps: int = 20
    lr: float = 1e-3
    loss_reduction: str = "token"
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "train.")


@dataclass
class Recipe:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    packing: PackingConfig = field(default_factory=PackingConfig)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Recipe":
        """Load and validate a recipe; unknown keys are errors naming the section and the key."""
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a YAML mapping with sections model, data, train, packing")
        unknown = sorted(set(raw) - {"model", "data", "train", "packing"})
        if unknown:
            raise ValueError(f"{path}: unknown section(s) {unknown}; expected model, data, train, packing")
        try:
            recipe = cls(
                model=_build(ModelSpec, raw.get("model"), "model"),
                data=_build(DataSpec, raw.get("data"), "data"),
                train=_build(TrainSpec, raw.get("train"), "train"),
                packing=PackingConfig.from_dict({} if raw.get("packing") is None else raw["packing"]),
            )
            recipe.packing.validate()
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return recipe


def _build(cls: type, values: Any, where: str) -> Any:
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"section '{where}' must be a mapping of keys, got {type(values).__name__} {values!r:.60}")
    reject_unknown_keys(cls, values, where)
    return cls(**values)


def offline_packed_datasets(
    config: PackingConfig, *, pad_token_id: int = 0
) -> tuple[PackedSFTDataset, PackedSFTDataset | None]:
    """Training and (when ``packed_val_data_path`` is set) validation packs named by ``config.packed_sequence_specs``.

    Every spec field is honoured: the paths, ``packed_sequence_size``, ``pad_to_max_length``, ``pad_cu_seqlens``
    and ``pad_seq_to_mult``; the config is validated first (paths exist and have the right suffix).
    """
    config.validate()
    specs = config.packed_sequence_specs
    if not specs.enabled or specs.packed_train_data_path is None:
        raise ValueError(
            "offline packed datasets need packed_sequence_specs.packed_sequence_size > 0 and packed_train_data_path "
            "(the training_<size>.npy written by `vlm-pack prepare`); set both"
        )

    def open_split(path: str) -> PackedSFTDataset:
        return PackedSFTDataset(
            path, specs.packed_sequence_size, metadata=specs.packed_metadata_path,
            pad_to_max_length=specs.pad_to_max_length, pad_cu_seqlens=specs.pad_cu_seqlens,
            pad_seq_to_mult=specs.pad_seq_to_mult, pad_token_id=pad_token_id,
        )

    validation = None if specs.packed_val_data_path is None else open_split(specs.packed_val_data_path)
    return open_split(specs.packed_train_data_path), validation
