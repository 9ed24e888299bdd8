"""Plan token-budget packs: bin-pack exact sample lengths, order packs for balanced data-parallel steps, store.

On disk (a folder, written to a temporary sibling and renamed into place; nothing needs pickle)::

    plan.json          metadata: pack_size, alignment, algorithm, counts, efficiency, packing_factor (the n to
                       divide the global batch size by), max_samples_per_pack, image-token balance
    order.npy          int64 sample indices, pack after pack
    offsets.npy        int64 [num_packs + 1]: pack k is order[offsets[k]:offsets[k+1]]
    tokens.npy / image_tokens.npy / images.npy
                       int64 per-sample counts in dataset order (what TokenBudgetPackDataset checks against)

Pack order: packs sorted by image-token load are cut into blocks of ``data_parallel_size`` consecutive packs
(one optimizer step across ranks, the ranks of a ``DistributedSampler`` taking consecutive indices), and the
blocks are shuffled with ``seed``. Every pack has about ``pack_size`` tokens, so tokens are balanced by
construction and image tokens (vision-tower work) by the blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..offline.algorithms import ALGORITHMS, group_by_pack, pack_lengths
from ..offline.storage import save_array
from .lengths import SampleLengths

__all__ = ["TokenBudgetPlan", "plan_token_budget_packs"]

_FORMAT = "vlm_pack.token_budget_plan/1"
_ARRAYS = ("order", "offsets", "tokens", "image_tokens", "images")


@dataclass(frozen=True)
class TokenBudgetPlan:
    """Which samples form each pack (``order[offsets[k]:offsets[k+1]]``), with the per-sample counts."""

    pack_size: int
    pad_to_multiple_of: int
    algorithm: str
    order: np.ndarray
    offsets: np.ndarray
    lengths: SampleLengths
    dropped: tuple[int, ...] = field(default=())

    @property
    def num_packs(self) -> int:
        return int(self.offsets.size - 1)

    def pack(self, k: int) -> np.ndarray:
        """Sample indices of pack ``k``, in the order they are concatenated."""
        if not 0 <= k < self.num_packs:
            raise IndexError(f"pack {k} out of range: the plan has {self.num_packs} packs")
        return self.order[self.offsets[k]:self.offsets[k + 1]]

    def aligned_tokens(self) -> np.ndarray:
        """Slots each sample occupies in a pack: its length rounded up to ``pad_to_multiple_of``."""
        m = self.pad_to_multiple_of
        return -(-self.lengths.tokens // m) * m

    def metadata(self) -> dict:
        """Counts and quality figures of the plan (also stored in ``plan.json``)."""
        per_pack = np.diff(self.offsets)
        slots = np.add.reduceat(self.aligned_tokens()[self.order], self.offsets[:-1]) if self.num_packs else []
        image_load = np.add.reduceat(self.lengths.image_tokens[self.order], self.offsets[:-1]) if self.num_packs else []
        real = int(self.lengths.tokens[self.order].sum())
        return {
            "format": _FORMAT,
            "pack_size": self.pack_size,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "algorithm": self.algorithm,
            "num_samples": int(self.order.size),
            "num_dropped": len(self.dropped),
            "num_packs": self.num_packs,
            "packing_factor": round(float(self.order.size / max(self.num_packs, 1)), 4),
            "packing_efficiency": round(real / max(self.num_packs * self.pack_size, 1), 6),
            "max_samples_per_pack": int(per_pack.max()) if self.num_packs else 0,
            "max_pack_tokens": int(np.max(slots)) if self.num_packs else 0,
            "image_tokens": int(self.lengths.image_tokens[self.order].sum()),
            "max_pack_image_tokens": int(np.max(image_load)) if self.num_packs else 0,
            "dropped": list(self.dropped),
        }

    def save(self, directory: str | Path) -> Path:
        """Write the plan folder atomically (temporary sibling, then rename); an existing plan is replaced."""
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            arrays = {"order": self.order, "offsets": self.offsets, "tokens": self.lengths.tokens,
                      "image_tokens": self.lengths.image_tokens, "images": self.lengths.images}
            for name, array in arrays.items():
                save_array(staging / f"{name}.npy", np.ascontiguousarray(array, dtype=np.int64))
            try:
                (staging / "plan.json").write_text(json.dumps(self.metadata(), indent=1) + "\n")
            except OSError as err:
                raise OSError(f"{target / 'plan.json'}: cannot write it ({err}); free disk space") from None
            if target.exists():
                retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
                os.replace(target, retired / "plan")
                os.replace(staging, target)
                shutil.rmtree(retired)
            else:
                os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    @classmethod
    def load(cls, directory: str | Path) -> "TokenBudgetPlan":
        """Read a plan folder (no pickle); every array is checked against ``plan.json``."""
        root = Path(directory)
        meta_path = root / "plan.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: {root} is not a token-budget plan (run vlm-pack plan-vlm)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{meta_path}: not valid JSON ({exc}); re-run vlm-pack plan-vlm") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_path}: expected a JSON object; re-run vlm-pack plan-vlm")
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
        arrays = {}
        for name in _ARRAYS:
            try:
                arrays[name] = np.load(root / f"{name}.npy", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{root / (name + '.npy')}: unreadable ({exc}); re-run vlm-pack plan-vlm") from exc
            if arrays[name].dtype != np.int64 or arrays[name].ndim != 1:
                raise ValueError(f"{root / (name + '.npy')}: expected 1-D int64, got {arrays[name].dtype} "
                                 f"{arrays[name].shape}; re-run vlm-pack plan-vlm")
        fields = {}
        for name, kind in (("pack_size", int), ("pad_to_multiple_of", int), ("algorithm", str)):
            value = meta.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{meta_path}: field {name!r} is {value!r}, not a {kind.__name__}; re-run "
                                 "vlm-pack plan-vlm")
            fields[name] = value
        dropped = meta.get("dropped", [])
        if not isinstance(dropped, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dropped):
            raise ValueError(f"{meta_path}: field 'dropped' must be a list of sample indices; re-run vlm-pack plan-vlm")
        try:
            plan = cls(**fields, order=arrays["order"], offsets=arrays["offsets"],
                       lengths=SampleLengths(arrays["tokens"], arrays["image_tokens"], arrays["images"]),
                       dropped=tuple(dropped))
        except ValueError as exc:
            raise ValueError(f"{root}: {exc}; re-run vlm-pack plan-vlm") from None
        _check_consistent(plan, meta, root)
        return plan


def _check_consistent(plan: TokenBudgetPlan, meta: dict, root: Path) -> None:
    """The arrays agree with each other and with the metadata (a tampered or truncated plan is refused)."""
    n = plan.lengths.tokens.size
    problems = []
    if plan.offsets.size == 0 or plan.offsets[0] != 0 or np.any(np.diff(plan.offsets) < 1) \
            or plan.offsets[-1] != plan.order.size:
        problems.append("offsets are not increasing from 0 to the number of planned samples")
    if plan.order.size and (plan.order.min() < 0 or plan.order.max() >= n
                            or np.unique(plan.order).size != plan.order.size):
        problems.append("order holds an out-of-range or repeated sample index")
    if plan.order.size + len(plan.dropped) != n:
        problems.append(f"{plan.order.size} planned + {len(plan.dropped)} dropped != {n} samples")
    if not problems and plan.num_packs and np.add.reduceat(plan.aligned_tokens()[plan.order],
                                                           plan.offsets[:-1]).max() > plan.pack_size:
        problems.append(f"a pack exceeds pack_size={plan.pack_size}")
    if not problems and meta != plan.metadata():
        problems.append("plan.json does not match the arrays")
    if problems:
        raise ValueError(f"{root}: inconsistent token-budget plan ({'; '.join(problems)}); re-run vlm-pack plan-vlm")


def plan_token_budget_packs(
    lengths: SampleLengths,
    pack_size: int,
    *,
    pad_to_multiple_of: int = 1,
    algorithm: str = "best_fit_decreasing",
    data_parallel_size: int = 1,
    seed: int = 0,
    on_overlong: Literal["error", "drop"] = "error",
) -> TokenBudgetPlan:
    """Bin-pack ``lengths`` into packs of at most ``pack_size`` slots (each sample aligned to
    ``pad_to_multiple_of``, e.g. ``pad_multiple(cp, tp, sp)``) and order the packs (see the module doc).

    A sample longer than a pack raises (naming it) unless ``on_overlong="drop"``, which records it in
    ``TokenBudgetPlan.dropped``; samples are never truncated.
    """
    for name, value in (("pack_size", pack_size), ("pad_to_multiple_of", pad_to_multiple_of),
                        ("data_parallel_size", data_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    if on_overlong not in ("error", "drop"):
        raise ValueError(f"on_overlong must be 'error' or 'drop'; got {on_overlong!r}")
    aligned = -(-lengths.tokens // pad_to_multiple_of) * pad_to_multiple_of
    overlong = np.flatnonzero(aligned > pack_size)
    if overlong.size and on_overlong == "error":
        first = int(overlong[0])
        raise ValueError(
            f"sample {first} has {int(lengths.tokens[first])} tokens (images expanded), more than pack_size="
            f"{pack_size} ({overlong.size} such samples). Raise pack_size, shrink images (processor max_pixels), "
            "or pass on_overlong='drop'; samples are never truncated."
        )
    kept = np.setdiff1d(np.arange(lengths.tokens.size), overlong)
    if kept.size == 0:
        raise ValueError(f"no sample fits pack_size={pack_size}; nothing to plan")
    bin_ids = pack_lengths(aligned[kept], int(pack_size), algorithm, seed=seed)
    order, offsets = group_by_pack(bin_ids)
    order, offsets = kept[order], offsets.astype(np.int64)
    order, offsets = _balanced_pack_order(order, offsets, lengths.image_tokens, data_parallel_size, seed)
    return TokenBudgetPlan(int(pack_size), int(pad_to_multiple_of), algorithm, order.astype(np.int64), offsets,
                           lengths, tuple(int(i) for i in overlong))


def _balanced_pack_order(order: np.ndarray, offsets: np.ndarray, image_tokens: np.ndarray, ranks: int,
                         seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Reorder packs: sorted by image-token load, cut into blocks of ``ranks``, blocks shuffled."""
    sizes = np.diff(offsets)
    load = np.add.reduceat(image_tokens[order], offsets[:-1])
    by_load = np.argsort(-load, kind="stable")
    blocks = [by_load[i:i + ranks] for i in range(0, by_load.size, ranks)]
    np.random.default_rng(seed).shuffle(blocks)
    packs = np.concatenate(blocks)
    new_sizes = sizes[packs]
    new_offsets = np.concatenate([[0], np.cumsum(new_sizes)]).astype(np.int64)
    shift = np.repeat(offsets[:-1][packs] - new_offsets[:-1], new_sizes)
    return order[np.arange(order.size) + shift], new_offsets
