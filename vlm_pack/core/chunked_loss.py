"""Cross entropy of a packed row from its final hidden states: the LM head runs in chunks, at target slots only.

The logits of a packed row are ``T x V`` floats (T = 32,768 and Qwen's V = 151,936: 18.5 GiB in fp32) and the plain
loss keeps two or three such tensors for the backward. Here the head is applied only where the next-token target is
not ``-100`` (after the per-sample shift), ``chunk_tokens`` slots at a time, and each chunk's forward runs again
in the backward (``torch.utils.checkpoint``) instead of being kept: at most a few ``chunk_tokens x V`` tensors exist
at once. When the loss is a weighted sum known up front (every training loss here) and the head is a plain
``nn.Linear``, :func:`hidden_weighted_loss` forms the gradients in the forward instead, chunk by chunk, as Liger's
fused linear cross entropy does: no chunk is computed twice, which keeps the step as fast as the full-logits one. The per-token losses are the same numbers as ``F.cross_entropy`` on the full logits, so every reduction of
:mod:`.loss` (token mean, per-sample mean, sums for distributed reduction) is exact.

The head is any module (``nn.Linear``, a tied embedding's projection, a PEFT-wrapped head, one with a bias): it is
called, never unpacked into a weight, so gradients reach whatever parameters it owns. :class:`LMHead` adds the
post-projection transforms a family applies (Gemma's final logit softcapping, Cohere's logit scale).

Under DeepSpeed ZeRO-3 (data parallel, or ``UlyssesTrainer``) a plain ``nn.Linear`` head is read once per loss
call, inside the model's forward, where DeepSpeed gathers its partitioned weight once and again for the backward
(:mod:`.zero3`); the fused path then forms its gradients in the forward, so no head call, hence no gather per chunk,
happens in either pass. A partitioned head of another kind is refused in training (its calls would gather per chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .loss import Reduction, _check_cu, sample_mean, shift_packed_labels
from .packing import IGNORE_INDEX, segment_ids
from .zero3 import require_gathered, zero3_gathered

__all__ = [
    "ACCELERATOR_CHUNK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "LMHead",
    "chunk_bounds",
    "chunk_tokens_for",
    "gathered_projection",
    "hidden_cross_entropy",
    "hidden_sample_sums",
    "hidden_token_losses",
    "hidden_weighted_loss",
    "row_targets",
]

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""fp32 logits of one chunk on CPU (64 MiB: 110 slots at V = 151,936); the backward holds about five such tensors."""

ACCELERATOR_CHUNK_BYTES = 1024 * 2**20
"""The same on a GPU (1 GiB: 1,765 slots at V = 151,936), where small matrix products would leave it idle."""


@dataclass(frozen=True)
class LMHead:
    """The output projection and what the family's forward does to its output before the loss.

    ``module``: called on ``[n, H]`` hidden states, returns ``[n, V]`` logits. ``scale``: multiplied into the logits
    (Cohere's ``logit_scale``). ``softcap``: ``tanh(logits / softcap) * softcap`` (Gemma's
    ``final_logit_softcapping``), after the scale, in the order of transformers' forwards.
    """

    module: Callable[[torch.Tensor], torch.Tensor]
    scale: float | None = None
    softcap: float | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(self.module(hidden))

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's post-projection transforms applied to the projection's output."""
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def vocab_size(self) -> int | None:
        """Output width, read from the module (``out_features`` or its weight); None when it shows neither."""
        width = getattr(self.module, "out_features", None)
        if width is None and isinstance(getattr(self.module, "weight", None), torch.Tensor):
            width = self.module.weight.shape[0]
        return None if width is None else int(width)


def chunk_tokens_for(vocab_size: int | None, chunk_bytes: int | None = None,
                     device: torch.device | None = None) -> int:
    """Slots per chunk so that one chunk's fp32 logits take about ``chunk_bytes`` (None: :data:`DEFAULT_CHUNK_BYTES`
    on CPU, :data:`ACCELERATOR_CHUNK_BYTES` elsewhere; at least 16 slots)."""
    if not vocab_size:
        return 1024
    if chunk_bytes is None:
        on_cpu = device is None or torch.device(device).type == "cpu"
        chunk_bytes = DEFAULT_CHUNK_BYTES if on_cpu else ACCELERATOR_CHUNK_BYTES
    return max(16, chunk_bytes // (4 * vocab_size))


def row_targets(labels: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of ``labels`` (``[B, S]`` or ``[T]``): per sample when boundaries are given, else a
    whole-row shift (exact on vlm_pack batches, whose sample starts are -100: Hugging Face's flattening rule)."""
    if cu_seqlens_padded is not None:
        return shift_packed_labels(labels, cu_seqlens_padded, ignore_index)
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def chunk_bounds(count: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``size`` slots over ``count`` slots (the last one shorter)."""
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def _chunk_losses(hidden: torch.Tensor, targets: torch.Tensor,
                  project: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(project(hidden).float(), targets, reduction="none")


def _sharded_names(head: LMHead) -> list[str]:
    """Names of the head's parameters an engine shards: DeepSpeed ZeRO-3 (``ds_id``, gathered now or not) or FSDP2
    (a DTensor: a head sharded on its own, outside its forward)."""
    from torch.distributed.tensor import DTensor

    parameters = getattr(head.module, "named_parameters", lambda: ())()
    return [name for name, p in parameters if hasattr(p, "ds_id") or isinstance(p, DTensor)]


def _refuse_sharded(head: LMHead) -> None:
    """A head whose weights an engine shards is read once per loss only on the fused path (a plain ``nn.Linear``
    under ZeRO-3); called per chunk it would gather them on every call (forward, and the recompute in the backward)
    and ranks with different chunk counts wait on each other (a 2-process FSDP2 run with a separately sharded head
    hung)."""
    names = _sharded_names(head)
    if names:
        raise ValueError(
            f"vlm_pack's chunked loss cannot read this LM head once per loss: a {type(head.module).__name__} whose "
            f"{', '.join(names[:4])} an engine shards (DeepSpeed ZeRO-3 takes a plain nn.Linear head; FSDP2 a head "
            "sharded with its parent, not by its own fully_shard). Leave the head out of the adapter / its own "
            "fully_shard, or pass enable_packing(model, chunked_loss=False) (the model's own loss over full logits)"
        )


@contextmanager
def gathered_projection(head: LMHead) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """``hidden -> logits`` for a block of head calls without autograd: ``head`` itself, or for a plain ``nn.Linear``
    head under ZeRO-3 its weight gathered once for the block (:func:`~.zero3.zero3_gathered`) and applied with
    ``F.linear``, instead of a module call (a gather) per chunk. Other sharded heads are refused."""
    if not _plain_weight(head):
        _refuse_sharded(head)
        yield head
        return
    module = head.module
    weight, bias = module.weight, module.bias
    with zero3_gathered(weight, bias):
        yield lambda hidden: head.transform(F.linear(hidden, weight, bias))


def hidden_token_losses(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor, *, chunk_tokens: int | None = None,
                        ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses [n] fp32, slots [n])``: the cross entropy at every slot whose target is not ignored.

    ``hidden``: ``[..., T, H]`` final hidden states (the head's input), ``targets``: already shifted, shaped like
    ``hidden[..., 0]``; ``slots`` index the flattened row. With autograd on, each chunk is recomputed in the backward
    (``torch.utils.checkpoint``); under ``no_grad`` it is simply computed. One host sync (the target count).
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_hidden.device)
    if flat_hidden.shape[0] != flat_targets.numel():
        raise ValueError(f"hidden states hold {flat_hidden.shape[0]} slots but targets {flat_targets.numel()}: pass "
                         "the packed row's final hidden states with its labels")
    slots = torch.nonzero(flat_targets != ignore_index).squeeze(1)
    picked, wanted = flat_hidden.index_select(0, slots), flat_targets.index_select(0, slots).long()
    size = chunk_tokens or chunk_tokens_for(head.vocab_size, device=flat_hidden.device)
    recompute = torch.is_grad_enabled() and (picked.requires_grad or any(
        p.requires_grad for p in getattr(head.module, "parameters", lambda: ())()))
    if recompute:
        _refuse_sharded(head)  # each chunk's call and its recompute would gather the weights again
    with gathered_projection(head) if not recompute else nullcontext(head) as project:
        pieces = [checkpoint(_chunk_losses, picked[start:end], wanted[start:end], project, use_reentrant=False)
                  if recompute else _chunk_losses(picked[start:end], wanted[start:end], project)
                  for start, end in chunk_bounds(slots.numel(), size)]
    # an empty tensor still connected to the graph, so backward() works on a batch without targets
    losses = torch.cat(pieces) if pieces else picked.sum(-1).float()
    return losses, slots


def _plain_weight(head: LMHead) -> bool:
    """A plain ``nn.Linear`` whose weight is an ordinary tensor: its gradient can be formed chunk by chunk in the
    forward (a ZeRO-3-partitioned one too: :mod:`.zero3`). Not a PEFT wrapper, nor FSDP2's DTensor (a separately
    sharded head outside its forward): those take the recomputing path, which calls the module (refused when an
    engine shards them: :func:`_refuse_sharded`)."""
    module = head.module
    return type(module) is torch.nn.Linear and type(module.weight) in (torch.Tensor, torch.nn.Parameter)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(head(h_i), t_i)`` with the gradients formed in the forward, chunk by chunk (Liger's fused
    linear cross entropy, in torch): per chunk ``dL/dz = w * (softmax(z) - onehot(t))`` (through the scale and the
    softcap), then ``dh = dz @ W``, ``dW += dz^T @ h``, ``db += sum dz``. Nothing of size ``chunk x V`` outlives its
    chunk and no chunk is computed twice; the backward only scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, scale, softcap, bounds):
        needs = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start, end in bounds:
            h, t, w = hidden[start:end], targets[start:end], weights[start:end]
            z = F.linear(h, weight, bias).float()
            if scale is not None:
                z = z * scale
            capped = None
            if softcap is not None:
                capped = torch.tanh(z / softcap)
                z = capped * softcap
            lse = torch.logsumexp(z, dim=-1)
            total = total + ((lse - z.gather(1, t[:, None]).squeeze(1)) * w).sum()
            if not any(needs[:3]):
                continue
            dz = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            dz.scatter_add_(1, t[:, None], dz.new_full((t.numel(), 1), -1.0))
            dz.mul_(w[:, None])
            if capped is not None:
                dz.mul_(1 - capped * capped)
            if scale is not None:
                dz.mul_(scale)
            if grad_hidden is not None:
                grad_hidden[start:end] = dz @ weight.float()
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h.float())
            if grad_bias is not None:
                grad_bias.add_(dz.sum(0))
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads = []
        for needed, stored, dtype in zip(ctx.needs_input_grad[:3], ctx.saved_tensors, ctx.dtypes):
            grads.append((stored * grad_output).to(dtype) if needed else None)
        return (*grads, None, None, None, None, None)


def hidden_weighted_loss(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor,
                         weights: torch.Tensor | float = 1.0, *, chunk_tokens: int | None = None,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``sum over target slots of weights * cross entropy``, never holding more than a chunk of logits.

    ``weights``: a number, or one per slot shaped like ``targets`` (e.g. ``1 / tokens of the slot's sample`` for the
    per-sample mean). A plain ``nn.Linear`` head (bias, tied weight, scale and softcap included) takes the fused path
    (:class:`_FusedLinearCrossEntropy`: gradients formed in the forward, each chunk computed once), its weight gathered
    once when ZeRO-3 partitions it; any other head (PEFT, an FSDP2-sharded weight, a custom module) takes
    :func:`hidden_token_losses`' recomputing path.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_hidden.device)
    if torch.is_tensor(weights):
        flat_weights = weights.reshape(-1).to(flat_hidden.device, torch.float32)
    else:
        flat_weights = torch.full(flat_targets.shape, float(weights), device=flat_hidden.device)
    if not _plain_weight(head):
        losses, slots = hidden_token_losses(hidden, head, targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index)
        return (losses * flat_weights.index_select(0, slots)).sum()
    if flat_hidden.shape[0] != flat_targets.numel():
        raise ValueError(f"hidden states hold {flat_hidden.shape[0]} slots but targets {flat_targets.numel()}: pass "
                         "the packed row's final hidden states with its labels")
    slots = torch.nonzero(flat_targets != ignore_index).squeeze(1)
    size = chunk_tokens or chunk_tokens_for(head.vocab_size, device=flat_hidden.device)
    module = head.module
    weight, bias = module.weight, module.bias  # under ZeRO-3, inside the forward: DeepSpeed gathers them (once)
    require_gathered(module, {"weight": weight, "bias": bias})
    with zero3_gathered(weight, bias):  # a frozen partitioned weight read outside the forward
        return _FusedLinearCrossEntropy.apply(
            flat_hidden.index_select(0, slots), weight, bias, flat_targets.index_select(0, slots).long(),
            flat_weights.index_select(0, slots), head.scale, head.softcap, chunk_bounds(slots.numel(), size))


def hidden_sample_sums(losses: torch.Tensor, sample_of_slot: torch.Tensor, num_samples: int,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(loss sums [N], target counts [N])`` of :func:`hidden_token_losses`' output, given the sample
    index of each scored slot (ids ``>= num_samples``, fill past the last boundary, are dropped)."""
    bucket = sample_of_slot.to(losses.device).clamp(max=num_samples)
    sums = losses.new_zeros(num_samples + 1).index_add(0, bucket, losses)[:num_samples]
    counts = losses.new_zeros(num_samples + 1).index_add(0, bucket, torch.ones_like(losses))[:num_samples]
    return sums, counts


def hidden_cross_entropy(hidden: torch.Tensor, head: LMHead, labels: torch.Tensor,
                         cu_seqlens_padded: torch.Tensor | None = None, *, reduction: Reduction = "token",
                         chunk_tokens: int | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """:func:`~vlm_pack.core.loss.packed_cross_entropy` from hidden states (``[1, T, H]`` or ``[T, H]``) and the
    head, never holding the ``T x V`` logits. Same labels (aligned with the tokens), reductions and results."""
    targets = row_targets(labels, cu_seqlens_padded, ignore_index)
    losses, slots = hidden_token_losses(hidden, head, targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index)
    if reduction == "token":
        return losses.sum() / max(slots.numel(), 1)
    if reduction == "none":
        return losses.new_zeros(targets.numel()).index_put((slots,), losses).view(labels.shape)
    if reduction == "sample":
        if cu_seqlens_padded is None:
            raise ValueError("reduction='sample' needs cu_seqlens_padded (the samples of the row)")
        cu = _check_cu(cu_seqlens_padded)
        return sample_mean(*hidden_sample_sums(losses, segment_ids(cu, slots), cu.numel() - 1))
    raise ValueError(f"reduction must be 'token', 'sample' or 'none'; got {reduction!r}")
