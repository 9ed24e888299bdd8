"""Packed preference data in TRL: DPO (``PackedDPOTrainer``) and reward models, chosen and rejected in one row.

``PreferenceCollator`` packs TRL's preference examples (optionally each prompt once: ``shared_prompts=True``);
the trainers subclass TRL's and read per-sequence log-probs / scores from the packed row. Names load on first
use (TRL is imported only then).
"""


from ..lazy_exports import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
