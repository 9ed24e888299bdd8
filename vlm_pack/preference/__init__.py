"""Packed preference data in TRL: DPO (``PackedDPOTrainer``) and reward models, chosen and rejected in one row.

``PreferenceCollator`` packs TRL's preference examples (optionally each prompt once: ``shared_prompts=True``);
the trainers subclass TRL's and read per-sequence log-probs / scores from the packed row. Names load on first
use (TRL is imported only then).
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "PreferenceCollator": "collator",
    "PackedDPOTrainer": "dpo",
    "sequence_logps": "dpo",
    "LOSS_TYPES": "losses",
    "RewardCollator": "reward",
    "PackedRewardTrainer": "reward",
    "sequence_scores": "reward",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vlm_pack.preference' has no attribute {name!r}")
