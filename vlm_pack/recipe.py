"""Fine-tuning recipes from YAML: model, data, training loop settings and the packing config, all typed.

A recipe file has four sections; ``packing`` is a :class:`~vlm_pack.config.PackingConfig`::

    model:    {family: qwen2_vl, checkpoint: null}      # tiny random model, or a local HF checkpoint path
    data:     {source: demo_mix, num_samples: 48}       # or a JSONL path (chat "messages" / prompt+response)
    train:    {steps: 20, lr: 1.0e-3, loss_reduction: token}
    packing:  {pack_sequences_in_batch: true, micro_batch_size: 4, ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import PackingConfig, reject_unknown_keys

__all__ = ["DataSpec", "ModelSpec", "Recipe", "TrainSpec"]


@dataclass
class ModelSpec:
    """``checkpoint``: a local Hugging Face model directory; without one a tiny random ``family`` model is built."""

    family: str = "qwen2_vl"
    checkpoint: str | None = None


@dataclass
class DataSpec:
    """``source``: ``demo_mix`` (shipped photos, VQA pairs and chats) or a JSONL path; ``prepared_root`` is
    where offline packs are written/read."""

    source: str = "demo_mix"
    num_samples: int = 48
    prompt_field: str = "prompt"
    response_field: str = "response"
    prepared_root: str = "runs/prepared"
    algorithm: str = "first_fit_decreasing"


@dataclass
class TrainSpec:
    steps: int = 20
    lr: float = 1e-3
    loss_reduction: str = "token"
    num_workers: int = 0
    seed: int = 0


@dataclass
class Recipe:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    packing: PackingConfig = field(default_factory=PackingConfig)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Recipe":
        """Load and validate a recipe; unknown keys are errors naming the section and the key."""
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle) or {}
        unknown = sorted(set(raw) - {"model", "data", "train", "packing"})
        if unknown:
            raise ValueError(f"{path}: unknown section(s) {unknown}; expected model, data, train, packing")
        recipe = cls(
            model=_build(ModelSpec, raw.get("model"), f"{path}: model"),
            data=_build(DataSpec, raw.get("data"), f"{path}: data"),
            train=_build(TrainSpec, raw.get("train"), f"{path}: train"),
            packing=PackingConfig.from_dict(raw.get("packing") or {}),
        )
        recipe.packing.validate()
        return recipe


def _build(cls: type, values: dict[str, Any] | None, where: str) -> Any:
    values = values or {}
    reject_unknown_keys(cls, values, where)
    return cls(**values)
