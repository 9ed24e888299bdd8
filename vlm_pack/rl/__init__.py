"""Packed reinforcement learning in TRL: ``PackedGRPOTrainer`` and ``PackedRLOOTrainer``.

TRL's trainers with their log-prob method replaced by one packed row per forward (each group's prompt and images
once with ``share_prompts=True``); everything else is TRL's. Names load on first use (TRL is imported only then).

Imports: ``core``, ``attention``, ``models``, ``data`` and ``integrations`` (a path, floor 6 of
tests/test_layers.py); TRL and PEFT where used. Nothing below imports it.
"""


from ..lazy_exports import lazy_getattr

_LAZY = {
    "PackedGRPOTrainer": "trainers",
    "PackedRLOOTrainer": "trainers",
    "RolloutPacker": "layout",
    "PackedRollouts": "layout",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
