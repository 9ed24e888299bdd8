"""``ulysses_setup``: everything DeepSpeed Ulysses needs for vlm_pack's packed rows, in one call."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .batch import UlyssesCollator
from .model import SP_ATTN_IMPLEMENTATION, prepare_model

__all__ = ["UlyssesSetup", "ulysses_setup", "zero3_config"]


@dataclass
class UlyssesSetup:
    """``model`` (prepared in place), ``data_collator`` and ``parallelism_config`` for ``TrainingArguments``."""

    model: Any
    data_collator: UlyssesCollator
    parallelism_config: Any


def zero3_config(**overrides: Any) -> dict[str, Any]:
    """A DeepSpeed ZeRO-3 config whose sizes Trainer fills in (``"auto"``); ``overrides`` update the top level."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}, **overrides}


def ulysses_setup(model: Any, collate_fn: Callable[[list[Any]], Mapping[str, Any]], sp_size: int, *,
                  pad_to_length: int | None = None, world_size: int | None = None) -> UlyssesSetup:
    """Prepare ``model`` (:func:`.model.prepare_model`), wrap ``collate_fn`` (any vlm_pack packing collator:
    ``VLMPackingCollator``, ``PackedSFTDataset.collate_fn``, ``PackedDataset.collate``, ``TokenBudgetPackDataset
    .collate_fn``) and build accelerate's ``ParallelismConfig(sp_size, sp_backend="deepspeed")`` whose Ulysses
    wrapper targets the language model's attention name. ``pad_to_length``: a fixed row width (required on gloo /
    CPU, whose all-gather needs equal widths on all SP ranks; see :func:`.batch.ulysses_batch`). ``world_size``:
    all processes (default: the launcher's ``WORLD_SIZE``); the data-parallel size ``world_size / sp_size`` goes
    into the ``ParallelismConfig`` (accelerate sizes DeepSpeed's ``train_batch_size`` from it).
    Train with :class:`.trainer.UlyssesTrainer`,
    ``TrainingArguments(parallelism_config=..., deepspeed=zero3_config(), per_device_train_batch_size=1)``."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    world = int(os.environ.get("WORLD_SIZE", sp_size)) if world_size is None else world_size
    if world % sp_size:
        raise ValueError(f"sp_size={sp_size} must divide the number of processes ({world})")
    prepare_model(model, sp_size)
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True)
    handler.sp_attn_implementation = SP_ATTN_IMPLEMENTATION  # after construction: its check knows only HF's names
    config = ParallelismConfig(sp_size=sp_size, sp_backend="deepspeed", sp_handler=handler,
                               dp_replicate_size=world // sp_size)
    return UlyssesSetup(model, UlyssesCollator(collate_fn, sp_size, pad_to_length), config)
