"""Distributed training on packed batches: exact loss reduction across ranks and a load-balancing sampler.

Loss: every rank contributes SUMS and COUNTS, never a local mean, so a rank whose slice holds no loss token
(common under context parallelism: a zigzag slice of prompt-only tokens) adds zero instead of NaN. One
all-reduce over the given group (typically data-parallel x context-parallel) yields the global denominators.

Sampler: :class:`BalancedPackingSampler` yields in-batch-packing micro-batches so that, at every optimizer
step, the data-parallel ranks get nearly the same number of tokens and of image tokens (vision-encoder load):
synchronous training waits for the slowest rank, so the per-step max/mean load is the time lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = [
    "BalancedPackingSampler",
    "ReducedLoss",
    "all_reduce_gradients",
    "reduce_per_sample_mean_loss",
    "reduce_per_token_loss",
]

GradSync = Literal["sum", "mean"]


@dataclass(frozen=True)
class ReducedLoss:
    """A loss reduced exactly across ranks.

    ``loss``: this rank's differentiable share; the shares of all ranks in the group add up to the global loss,
    so back-propagating ``loss`` on every rank and SUMMING gradients over the group gives the exact global
    gradient (with ``grad_sync="mean"`` it is pre-scaled by the group size for averaging gradient sync).
    ``value``: the detached global loss, identical on every rank (for logging).
    ``count``: the global denominator (loss tokens, or samples holding at least one loss token).
    """

    loss: torch.Tensor
    value: torch.Tensor
    count: torch.Tensor


def _group_size(group: Any) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialised and no group was given."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    return 1


def _grad_scale(group: Any, grad_sync: GradSync) -> int:
    if grad_sync not in ("sum", "mean"):
        raise ValueError(
            f"grad_sync must be 'sum' or 'mean' (how gradients are combined over the group); got {grad_sync!r}"
        )
    return _group_size(group) if grad_sync == "mean" else 1


def _all_reduce_sum(stats: torch.Tensor, group: Any) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return stats


def reduce_per_token_loss(
    loss_sum: torch.Tensor, token_count: torch.Tensor | int, group: Any = None, *, grad_sync: GradSync = "sum"
) -> ReducedLoss:
    """Global per-token mean from each rank's ``(sum of token losses, number of loss tokens)``.

    One all-reduce of ``[sum, count]``. ``loss = loss_sum / global_count``: zero (not NaN) for a rank without
    loss tokens, and zero everywhere when the whole group has none. ``grad_sync="mean"`` multiplies ``loss`` by
    the group size, for gradient sync that AVERAGES over the same group (DDP / FSDP over DP x CP).

    Args:
        loss_sum: 0-dim SUM of this rank's token losses.
        token_count: this rank's loss tokens.
        group: the process group (None: the default group).
        grad_sync: ``"sum"`` or ``"mean"``: how the gradients are synchronised over ``group``.

    Returns:
        A :class:`ReducedLoss`: this rank's differentiable share and the global value (for logging).
    """
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
        raise ValueError("loss_sum must be a 0-dim tensor (the SUM of this rank's token losses, not a mean)")
    count = torch.as_tensor(token_count, device=loss_sum.device)
    if count.dim() != 0:
        raise ValueError(f"token_count must be a scalar; got shape {tuple(count.shape)}")
    stats = torch.stack([loss_sum.detach().double(), count.double()])
    total_sum, total_count = _all_reduce_sum(stats, group).unbind()
    denom = total_count.clamp_min(1)
    scale = _grad_scale(group, grad_sync)
    return ReducedLoss(
        loss=loss_sum * (scale / denom).to(loss_sum.dtype),
        value=(total_sum / denom).to(loss_sum.dtype),
        count=total_count,
    )


def reduce_per_sample_mean_loss(
    sample_loss_sums: torch.Tensor,
    sample_token_counts: torch.Tensor,
    group: Any = None,
    *,
    grad_sync: GradSync = "sum",
) -> ReducedLoss:
    """Mean over samples of each sample's mean token loss, exact when a sample's tokens span several ranks.

    Both inputs are ``[G]``, keyed by GLOBAL sample id (``G`` samples in the step's global batch across the
    DP x CP group): this rank's partial loss sum and loss-token count of every sample, zero for samples it
    does not hold. E.g. ``vlm_pack.core.loss.per_sample_loss_sums`` on the rank's slice (segment ids from
    ``vlm_pack.core.packing.segment_ids(cu_seqlens_padded, zigzag_indices(...))``), placed at
    ``dp_rank * samples_per_rank`` with ``F.pad``. One all-reduce of ``2 * G`` values; samples without loss
    tokens are skipped; never NaN.
    """
    if sample_loss_sums.dim() != 1 or sample_token_counts.shape != sample_loss_sums.shape:
        raise ValueError(
            f"sample_loss_sums and sample_token_counts must be 1-D [G] of equal length (one entry per global "
            f"sample id); got {tuple(sample_loss_sums.shape)} and {tuple(sample_token_counts.shape)}"
        )
    num_samples = sample_loss_sums.numel()
    stats = torch.cat([sample_loss_sums.detach().double(), sample_token_counts.detach().double()])
    stats = _all_reduce_sum(stats, group)
    total_sums, total_counts = stats[:num_samples], stats[num_samples:]
    present = total_counts > 0
    # Each sample weighs 1 / (its global token count * number of samples with loss tokens).
    weights = 1.0 / (total_counts.clamp_min(1) * present.sum().clamp_min(1))
    scale = _grad_scale(group, grad_sync)
    return ReducedLoss(
        loss=(sample_loss_sums * (scale * weights).to(sample_loss_sums.dtype)).sum(),
        value=(total_sums * weights).sum().to(sample_loss_sums.dtype),
        count=present.sum().double(),
    )


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: Any = None) -> None:
    """SUM ``.grad`` of ``parameters`` over ``group`` in place: one flat all-reduce per dtype/device."""
    if _group_size(group) == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            buckets.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


def _as_counts(name: str, values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence (one entry per sample); got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating) or not np.all(np.isfinite(array)) or np.any(array % 1):
            raise ValueError(f"{name} must hold whole numbers (token counts); got dtype {array.dtype}")
    negative = np.flatnonzero(array < 0)
    if negative.size:
        raise ValueError(f"{name}[{negative[0]}] = {array[negative[0]]} is negative: counts must be >= 0")
    return array.astype(np.int64)


def _refine(plan: np.ndarray, tokens: np.ndarray, images: np.ndarray, max_rounds: int = 64) -> np.ndarray:
    """Local search after the greedy deal: swap one sample of a step's most loaded rank with one of another
    rank when that lowers the pair's larger normalised load. Counts per rank stay fixed.

    ``tokens`` / ``images``: normalised costs shaped like ``plan`` ``[steps, ranks, per_rank]``. Vectorised over
    steps (in blocks, to bound memory); steps that stop improving leave the active set.
    """
    plan, tokens, images = plan.copy(), tokens.copy(), images.copy()
    _, replicas, per_rank = plan.shape
    block = max(1, 4_000_000 // (replicas * per_rank * per_rank))
    active = np.arange(plan.shape[0])
    for _ in range(max_rounds):
        improved = []
        for rows in np.array_split(active, max(1, -(-active.size // block))):
            token_load, image_load = tokens[rows].sum(axis=2), images[rows].sum(axis=2)
            worst = np.maximum(token_load, image_load).argmax(axis=1)
            local = np.arange(rows.size)
            # Swapping item i of the worst rank with item j of rank b moves d = cost[b, j] - cost[worst, i].
            d_tok = tokens[rows][:, :, None, :] - tokens[rows, worst][:, None, :, None]
            d_img = images[rows][:, :, None, :] - images[rows, worst][:, None, :, None]
            worst_after = np.maximum(
                token_load[local, worst][:, None, None, None] + d_tok,
                image_load[local, worst][:, None, None, None] + d_img,
            )
            other_after = np.maximum(token_load[:, :, None, None] - d_tok, image_load[:, :, None, None] - d_img)
            pair = np.maximum(worst_after, other_after)
            pair[local, worst] = np.inf
            flat = pair.reshape(rows.size, -1)
            best = flat.argmin(axis=1)
            gain = flat[local, best] < np.maximum(token_load, image_load)[local, worst] - 1e-9
            if not gain.any():
                continue
            step, a = rows[gain], worst[gain]
            b, i, j = np.unravel_index(best[gain], (replicas, per_rank, per_rank))
            for array in (plan, tokens, images):
                array[step, a, i], array[step, b, j] = array[step, b, j], array[step, a, i].copy()
            improved.append(step)
        if not improved:
            break
        active = np.concatenate(improved)
    return plan


_STATE_CONFIG_KEYS = ("num_samples", "num_replicas", "micro_batch_size", "window_steps", "seed", "shuffle", "drop_last")


class BalancedPackingSampler(Sampler[list[int]]):
    """Batch sampler for in-batch packing: micro-batches of ``micro_batch_size`` samples per data-parallel rank,
    balanced per optimizer step by token count and image-token count.

    Semantics follow ``DistributedSampler`` + ``BatchSampler``: each epoch shuffles with ``(seed, epoch)`` (call
    :meth:`set_epoch`), every rank derives the same global plan and takes its own column, and all ranks yield
    the same number of micro-batches. Remainder: with ``drop_last=False`` the shuffled list is extended by
    repeating its head (like ``DistributedSampler``) to a multiple of ``num_replicas * micro_batch_size``, so
    every sample appears at least once and fewer than ``num_replicas * micro_batch_size`` appear twice; with
    ``drop_last=True`` the tail is dropped (every sample at most once). When the sample count is a multiple of
    ``num_replicas * micro_batch_size`` every sample appears exactly once either way.

    Balancing: the shuffled list is cut into windows of ``window_steps`` global batches. Inside a window samples
    are sorted by token length and cut into steps, so a step holds samples of similar length; each step's samples
    are dealt to ranks longest-first, each to the rank whose larger normalised load (tokens or image tokens)
    stays smallest, then pairwise swaps lower the most loaded rank further. Step order and the rank that gets
    each micro-batch are shuffled again. ``window_steps=1`` keeps every step's random sample mix and balances
    only inside it; larger windows balance better (see ``benchmarks/balanced_sampler.py``) at the cost of steps
    grouping samples of similar length (like ``group_by_length``).

    Resume: ``state_dict()`` / ``load_state_dict()`` restore the epoch and position; ``len()`` is the number of
    micro-batches the next iteration yields.
    """

    def __init__(
        self,
        token_lengths: Sequence[int] | np.ndarray | torch.Tensor,
        image_token_counts: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        *,
        micro_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        window_steps: int = 16,
    ) -> None:
        tokens = _as_counts("token_lengths", token_lengths)
        images = (
            np.zeros_like(tokens)
            if image_token_counts is None
            else _as_counts("image_token_counts", image_token_counts)
        )
        if images.shape != tokens.shape:
            raise ValueError(
                f"image_token_counts has {images.size} entries but token_lengths has {tokens.size}: one per sample"
            )
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        sizes = {"micro_batch_size": micro_batch_size, "num_replicas": num_replicas, "window_steps": window_steps}
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if not (isinstance(rank, int) and 0 <= rank < num_replicas):
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}); got {rank!r}")
        step = num_replicas * micro_batch_size
        if drop_last and tokens.size < step:
            raise ValueError(
                f"drop_last=True with {tokens.size} samples < num_replicas * micro_batch_size = {step} leaves no "
                "micro-batch: use drop_last=False or a smaller micro_batch_size"
            )
        self.num_samples = int(tokens.size)
        self.num_replicas = num_replicas
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.window_steps = window_steps
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self._next = 0
        self._tokens = tokens.astype(np.float64)
        self._images = images.astype(np.float64)
        self._cached_plan: tuple[int, np.ndarray] | None = None

    @property
    def num_steps(self) -> int:
        """Micro-batches each rank gets per epoch (= optimizer steps per epoch without accumulation)."""
        step = self.num_replicas * self.micro_batch_size
        return self.num_samples // step if self.drop_last else -(-self.num_samples // step)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; a new epoch restarts at its first micro-batch (a resumed one does not)."""
        if epoch != self.epoch:
            self._next = 0
        self.epoch = epoch

    def epoch_plan(self) -> np.ndarray:
        """Sample indices of the whole epoch, ``[num_steps, num_replicas, micro_batch_size]`` (same on every rank)."""
        if self._cached_plan is None or self._cached_plan[0] != self.epoch:
            plan = self._plan()
            plan.setflags(write=False)  # cached and shared by every iteration of this epoch
            self._cached_plan = (self.epoch, plan)
        return self._cached_plan[1]

    def _plan(self) -> np.ndarray:
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        step = self.num_replicas * self.micro_batch_size
        order = order[: self.num_steps * step] if self.drop_last else np.resize(order, self.num_steps * step)
        window = np.arange(order.size) // (self.window_steps * step)
        by_length = np.lexsort((-self._tokens[order], window))  # per window, longest first
        steps = order[by_length].reshape(self.num_steps, step)
        plan = _refine(*self._deal(steps))
        if not self.shuffle:
            return plan
        # Shuffle step order, and which rank gets which micro-batch, so no rank is always the heaviest.
        ranks = np.argsort(rng.random((self.num_steps, self.num_replicas)), axis=1)
        return np.take_along_axis(plan, ranks[:, :, None], axis=1)[rng.permutation(self.num_steps)]

    def _deal(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Greedy longest-first: each sample of a step goes to the rank whose larger normalised load (tokens or
        image tokens) stays smallest, ``micro_batch_size`` per rank. Returns the plan and its normalised costs.

        Loads are in units of the step's mean per-rank load (1.0 = perfectly balanced). Vectorised over steps;
        the Python loop runs over the ``num_replicas * micro_batch_size`` slots of one step.
        """
        num_steps, width = steps.shape
        replicas, per_rank = self.num_replicas, self.micro_batch_size
        costs = []
        for raw in (self._tokens[steps], self._images[steps]):
            mean_load = raw.sum(axis=1, keepdims=True) / replicas
            costs.append(raw / np.where(mean_load > 0, mean_load, 1.0))
        tokens, images = costs
        token_load = np.zeros((num_steps, replicas))
        image_load = np.zeros((num_steps, replicas))
        filled = np.zeros((num_steps, replicas), dtype=np.int64)
        plan = np.empty((num_steps, replicas, per_rank), dtype=np.int64)
        plan_tokens = np.empty((num_steps, replicas, per_rank))
        plan_images = np.empty((num_steps, replicas, per_rank))
        rows = np.arange(num_steps)
        for slot in range(width):
            t, v = tokens[:, slot], images[:, slot]
            bottleneck = np.maximum(token_load + t[:, None], image_load + v[:, None])
            bottleneck[filled >= per_rank] = np.inf
            target = bottleneck.argmin(axis=1)
            place = (rows, target, filled[rows, target])
            plan[place], plan_tokens[place], plan_images[place] = steps[:, slot], t, v
            token_load[rows, target] += t
            image_load[rows, target] += v
            filled[rows, target] += 1
        return plan, plan_tokens, plan_images

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.epoch_plan()
        start = self._next if self._next < self.num_steps else 0
        for step in range(start, self.num_steps):
            self._next = step + 1
            yield plan[step, self.rank].tolist()

    def __len__(self) -> int:
        return self.num_steps - self._next if self._next < self.num_steps else self.num_steps

    def state_dict(self, micro_batches_consumed: int | None = None) -> dict[str, Any]:
        """Epoch, position and settings. The position defaults to micro-batches handed out so far this epoch;
        a DataLoader prefetches ahead, so pass the number the training loop actually consumed when it differs.
        """
        position = self._next if micro_batches_consumed is None else micro_batches_consumed
        state = {key: getattr(self, key) for key in _STATE_CONFIG_KEYS}
        state.update(epoch=self.epoch, next_micro_batch=int(position))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; settings must match (the rank may differ: every rank shares the plan)."""
        for key in (*_STATE_CONFIG_KEYS, "epoch", "next_micro_batch"):
            if key not in state:
                raise ValueError(
                    f"sampler state is missing {key!r}: pass a dict from BalancedPackingSampler.state_dict()"
                )
        for key in _STATE_CONFIG_KEYS:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}: resume with the same dataset and settings"
                )
        position = state["next_micro_batch"]
        if not (isinstance(position, int) and 0 <= position <= self.num_steps):
            raise ValueError(f"next_micro_batch={position!r} is outside [0, {self.num_steps}] micro-batches per epoch")
        self.epoch = state["epoch"]
        self._next = position
