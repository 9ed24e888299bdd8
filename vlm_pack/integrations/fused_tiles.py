"""Smaller tiles for TRL's fused LM head inside vlm_pack's TRL trainers: a long packed row never holds its logits.

TRL 1.16's ``fused_lm_head=True`` projects ``[4096 tokens, 32,768 vocabulary]`` tiles (``TOKEN_CHUNK_SIZE`` in
``trl.kernels.chunked_logprob``, ``_CHUNKED_LOGPROB_CHUNK_SIZE`` in ``trl.trainer.utils``); without Triton (CPU, and
every slot of the row is scored there) each tile is folded by whole-tile torch ops, so a T = 2048 row held 1.85x its
``T x V`` logits (V = 151,936). ``PackedSFTTrainer`` / ``PackedDPOTrainer`` / ``PackedGRPOTrainer`` /
``PackedRLOOTrainer`` run their steps, evaluations and rollout scoring with ``[TOKEN_TILE, VOCAB_TILE]`` tiles
instead: the same kernel, the same online log-sum-exp, only smaller pieces (the sums change order, not value: exact
against TRL's own trainers, tests/test_long_row_sources.py); benchmarks/results/long_rows_issue45_cpu.md gives the
peaks. Both names are read by TRL at call time, so they are set for the duration of each call and restored after it
(other trainers in the process keep TRL's tiles). A TRL without them keeps its own tiles, with one warning.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

__all__ = ["TOKEN_TILE", "VOCAB_TILE", "FusedTiles", "fused_tiles"]

TOKEN_TILE = 1024
VOCAB_TILE = 4096
"""Tile of TRL's fused head in vlm_pack's trainers: 4 Mi slots, 0.007x a 4096-token row's logits at V = 151,936."""

_SETTINGS = (("trl.kernels.chunked_logprob", "TOKEN_CHUNK_SIZE", "TOKEN_TILE"),
             ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE", "VOCAB_TILE"))
logger = logging.getLogger(__name__)
_warned: list[bool] = []


@contextlib.contextmanager
def fused_tiles(tokens: int | None = None, vocab: int | None = None) -> Iterator[None]:
    """TRL's fused-head tiles set to ``[tokens, vocab]`` (default :data:`TOKEN_TILE` x :data:`VOCAB_TILE`) inside."""
    values = {"TOKEN_TILE": tokens or TOKEN_TILE, "VOCAB_TILE": vocab or VOCAB_TILE}
    saved = []
    for module_name, name, key in _SETTINGS:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            if not _warned:
                _warned.append(True)
                logger.warning(f"{module_name}.{name} is gone in this TRL: its fused LM head keeps its own tiles "
                               "(a long row may hold about twice its logits)")
            continue
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, values[key])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class FusedTiles:
    """Mixin for a TRL trainer: its training step and prediction step (forward and backward) run in
    :func:`fused_tiles`."""

    def training_step(self, *args, **kwargs):
        with fused_tiles():
            return super().training_step(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        with fused_tiles():
            return super().prediction_step(*args, **kwargs)
