"""The loss of an ``enable_packing`` model from its final hidden states: a long packed row never holds ``T x V`` logits.

A training forward with ``labels`` (what ``Trainer(model=enable_packing(model))`` calls) computes its loss with
:func:`~vlm_pack.core.chunked_loss.hidden_weighted_loss`: the LM head runs in chunks, at target slots only, the
gradients formed chunk by chunk (a plain ``nn.Linear`` head) or each chunk recomputed in the backward (any other). The rule is the model's own loss (Hugging Face's ``ForCausalLMLoss``): targets
are the labels shifted over the whole row (exact on vlm_pack batches, whose sample starts are -100), the sum is
divided by Trainer's ``num_items_in_batch`` when the forward gets it, else by the target count; a mixture-of-experts
router loss is added with the model's coefficient, as the model does. ``logits`` then is a :class:`DeferredLogits`:
the head's input, turned into the full logits only if something uses it as a tensor (logits are computed when
asked, as in TRL's fused head and Liger's fused linear cross entropy).

How: forward hooks on the module that owns the loss (the outermost ``...ForCausalLM`` / ``...ForConditionalGeneration``
whose forward takes ``labels``). For an armed call the pre-hook takes ``labels`` out of the call and a one-call
pre-hook on the LM head records its input and hands the head an empty slice (zero slots: no logits); the forward
hook then builds the output. Other calls run unchanged:

* ``model(..., labels=...)`` in training mode: the loss from hidden states (above);
* a training call without labels that carries the batch bookkeeping (``batch["vlm_pack"]``): what
  ``Trainer(compute_loss_func=...)`` sends after taking the labels away; ``logits`` is deferred, and
  :func:`vlm_pack.compute_loss_func` / :class:`~vlm_pack.SampleMeanLoss` score it in chunks;
* a call with ``vlm_pack_targets=`` (:data:`TARGETS_KWARG`, taken out of the call; already-shifted targets, e.g. a
  sequence-parallel rank's slice): ``loss`` is their summed cross entropy, formed inside the forward, and ``logits``
  deferred, in any mode (the sequence-parallel trainer uses it);
* evaluation forwards with labels of a model that :class:`~vlm_pack.PackedEvaluation` watches: ``logits`` becomes
  ``[B, T, 2]`` per-slot scores (argmax id, cross entropy of the next label), the loss their token mean;
* left alone: TRL's ``fused_lm_head=True`` calls and a forward that Liger's kernels (``use_liger_kernel`` /
  ``liger_kernel_config``) or Cut Cross-Entropy's ``cce_patch`` replaced (:func:`fused_peer`: each computes its own
  loss without the logits, exact on packed rows since sample starts are -100; a PEFT adapter on the head, which
  they would leave untrained, is refused), calls with ``logits_to_keep`` and no labels, evaluation without
  ``PackedEvaluation``.

Under DeepSpeed ZeRO-3 (data parallel, or ``UlyssesTrainer``) a partitioned plain ``nn.Linear`` head is read once
per loss call and per evaluation scoring, inside the forward, where DeepSpeed gathers it (:mod:`vlm_pack.core.zero3`).
Refused at the first loss, naming ``chunked_loss=False``: a partitioned head of another kind (a PEFT wrapper), and
``compute_loss_func`` / ``SampleMeanLoss`` (they score the deferred logits after the forward).

Family rules, by name: Gemma 3 / 4's ``final_logit_softcapping`` and Cohere 2's ``logit_scale`` are applied in each
chunk (:data:`LOGIT_TRANSFORMS`); a loss owner whose forward transforms its logits in a way not listed is refused
when the hooks are installed. Tied embeddings, a head bias and PEFT-wrapped heads need nothing: the head module is
called, so gradients reach what it owns. ``logits_to_keep`` with labels in training is refused (the loss scores
every target).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from ..core.batch import METADATA_KEY
from ..core.chunked_loss import (
    LMHead,
    chunk_tokens_for,
    gathered_projection,
    hidden_weighted_loss,
    row_targets,
)
from ..core.packing import IGNORE_INDEX
from ..models import text_config

__all__ = [
    "LOGIT_TRANSFORMS",
    "TARGETS_KWARG",
    "DeferredLogits",
    "FUSED_PEERS",
    "fused_peer",
    "install_hidden_loss",
    "loss_owner",
    "score_slots_in_evaluation",
    "slot_scores",
]

TARGETS_KWARG = "vlm_pack_targets"
"""Forward kwarg: already-shifted next-token targets shaped like ``input_ids``; an ``enable_packing`` model returns
``loss`` = their summed cross entropy (chunked, formed inside the forward: where DeepSpeed ZeRO-3 gathers a
partitioned head) and :class:`DeferredLogits`."""

LOGIT_TRANSFORMS: dict[str, Callable[[torch.nn.Module], dict[str, float | None]]] = {
    "Gemma3ForCausalLM": lambda m: {"softcap": m.config.final_logit_softcapping},
    "Gemma4ForCausalLM": lambda m: {"softcap": m.config.final_logit_softcapping},
    "Gemma4ForConditionalGeneration": lambda m: {"softcap": m.config.get_text_config().final_logit_softcapping},
    "Gemma4UnifiedForCausalLM": lambda m: {"softcap": m.config.final_logit_softcapping},
    "Gemma4UnifiedForConditionalGeneration":
        lambda m: {"softcap": m.config.get_text_config().final_logit_softcapping},
    "Cohere2ForCausalLM": lambda m: {"scale": m.logit_scale},
    "Gemma3nForCausalLM": lambda m: {"softcap": m.config.final_logit_softcapping},
    "Gemma3nForConditionalGeneration": lambda m: {"softcap": m.config.get_text_config().final_logit_softcapping},
    "PaliGemmaForConditionalGeneration":
        lambda m: {"softcap": getattr(m.config.get_text_config(), "final_logit_softcapping", None)},
    # logits / logits_scaling
    "Granite4VisionForConditionalGeneration": lambda m: {"scale": 1.0 / m.config.text_config.logits_scaling},
    "GraniteDoclingForConditionalGeneration": lambda m: {"scale": 1.0 / m.config.text_config.logits_scaling},
    # logits * logits_scaling (MuP, unlike Granite's division)
    "HyperCLOVAXForCausalLM": lambda m: {"scale": m.config.logits_scaling},
    "HyperCLOVAXVisionV2ForConditionalGeneration": lambda m: {"scale": m.config.text_config.logits_scaling},
}
"""What each loss owner's forward does to the head's output (read from transformers 5.24's forwards)."""

_TRANSFORM_MARKS = frozenset({"final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                              "lm_head_multiplier", "output_multiplier"})
"""Names whose use in a forward's code (not its docstring) means the logits are transformed after the head."""


class DeferredLogits:
    """The LM head's input standing in for ``logits``: ``hidden`` ``[B, T, H]`` and the ``head``.

    Chunked losses read ``hidden`` / ``head``; anything using it as a tensor (a torch function, an attribute, an
    index) gets the full logits, computed once on first use (``materialize()``), with autograd as usual.
    """

    def __init__(self, hidden: torch.Tensor, head: LMHead, chunk_tokens: int | None = None):
        self.hidden, self.head, self.chunk_tokens = hidden, head, chunk_tokens
        self._logits: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        """The full ``[B, T, V]`` logits (the memory this class exists to avoid)."""
        if self._logits is None:
            self._logits = self.head(self.hidden)
        return self._logits

    def detach(self) -> DeferredLogits:
        return DeferredLogits(self.hidden.detach(), self.head, self.chunk_tokens)

    @property
    def shape(self) -> torch.Size:
        vocab = self.head.vocab_size
        return self.materialize().shape if vocab is None else torch.Size((*self.hidden.shape[:-1], vocab))

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.materialize()[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(value):
            if isinstance(value, DeferredLogits):
                return value.materialize()
            if isinstance(value, (list, tuple)):
                return type(value)(real(v) for v in value)
            return value

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"DeferredLogits(hidden={tuple(self.hidden.shape)}, vocab={self.head.vocab_size})"


@dataclass
class _Call:
    """One armed forward: what the pre-hook took out and what the head's pre-hook recorded."""

    labels: torch.Tensor | None
    num_items: Any
    score: bool
    targets: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    handle: Any = None


def _owns_loss(module: torch.nn.Module) -> bool:
    if not isinstance(module, transformers.PreTrainedModel) or module.get_output_embeddings() is None:
        return False
    return "labels" in inspect.signature(module.forward).parameters


def loss_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost module of ``model`` whose forward computes the LM loss from its head (None when none)."""
    return next((module for module in model.modules() if _owns_loss(module)), None)


def _logit_transform(owner: torch.nn.Module) -> dict[str, float | None]:
    name = type(owner).__name__
    if name in LOGIT_TRANSFORMS:
        return LOGIT_TRANSFORMS[name](owner)
    tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    marks = sorted(used & _TRANSFORM_MARKS)
    if marks:
        raise ValueError(
            f"{name}.forward transforms its logits ({', '.join(marks)}) in a way vlm_pack's chunked loss does not "
            "know: add the rule to vlm_pack.integrations.head_loss.LOGIT_TRANSFORMS, or pass "
            "enable_packing(model, chunked_loss=False)"
        )
    return {}


FUSED_PEERS = {"liger_kernel": "Liger's fused linear cross entropy", "cut_cross_entropy": "Cut Cross-Entropy"}
"""Libraries whose patched forward computes the loss without the logits; vlm_pack then leaves the loss to them."""


def fused_peer(owner: torch.nn.Module) -> str | None:
    """The peer (:data:`FUSED_PEERS`) whose forward replaced ``owner``'s on the instance, None when stock.

    Their losses shift the labels over the whole row, so they are exact on vlm_pack's rows (every sample start is
    -100) and honour ``num_items_in_batch``; they multiply hidden states by ``lm_head.weight`` directly, so a PEFT
    adapter on the head would not be trained: refused by :func:`_arm`."""
    forward = owner.__dict__.get("forward")
    module = getattr(getattr(forward, "__func__", forward), "__module__", None) or ""
    return next((name for library, name in FUSED_PEERS.items() if module.split(".")[0] == library), None)


def _arm(owner: torch.nn.Module, args: tuple, kwargs: dict):
    targets = kwargs.pop(TARGETS_KWARG, None)
    labels = kwargs.get("labels")
    keep = kwargs.get("logits_to_keep")
    score = labels is not None and not owner.training and getattr(owner, "_vlm_pack_score_slots", False)
    peer = fused_peer(owner)
    if peer is not None and type(owner.get_output_embeddings()).__module__.startswith("peft.tuners"):
        raise ValueError(
            f"{peer} computes the loss from lm_head.weight, but {type(owner).__name__}'s head is a "
            f"{type(owner.get_output_embeddings()).__name__} (a PEFT adapter?): the adapter would not be trained. "
            "Leave the head out of the adapter, or turn the peer's fused loss off (vlm_pack's chunked loss handles it)"
        )
    if kwargs.get("fused_lm_head") or peer is not None:
        mode = None
    elif labels is not None and (owner.training or score):
        mode = "loss"
        if keep not in (None, 0):
            raise ValueError(
                f"{type(owner).__name__} got labels with logits_to_keep={keep!r}: vlm_pack's chunked loss scores "
                "every target of the row; drop logits_to_keep from a training call with labels"
            )
    elif targets is not None or (owner.training and labels is None and METADATA_KEY in kwargs):
        mode = "deferred" if keep in (None, 0) else None
    else:
        mode = None
    owner._vlm_pack_calls.append(
        None if mode is None else _Call(labels, kwargs.get("num_items_in_batch"), score, targets))
    if mode is None:
        return (args, kwargs) if targets is not None else None
    call = owner._vlm_pack_calls[-1]
    kwargs.pop("labels", None)

    def record(head, head_args):
        call.hidden = head_args[0]
        return (head_args[0][..., :0, :],)  # zero slots: the forward's own logits cost nothing

    call.handle = owner.get_output_embeddings().register_forward_pre_hook(record)
    return args, kwargs


def slot_scores(hidden: torch.Tensor, head: LMHead, labels: torch.Tensor, chunk_tokens: int | None = None,
                ) -> torch.Tensor:
    """``[B, T, 2]`` fp32 per slot: the argmax token of its logits and the cross entropy of the next label (0 where
    that is -100), in chunks of slots without autograd. Token ids are exact in fp32 up to 2**24."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = row_targets(labels).reshape(-1).to(flat.device)
    scores = torch.zeros(flat.shape[0], 2, dtype=torch.float32, device=flat.device)
    size = chunk_tokens or chunk_tokens_for(head.vocab_size, device=flat.device)
    starts = range(0, flat.shape[0], size)
    with torch.no_grad(), gathered_projection(head) as project:  # a ZeRO-3-partitioned weight: gathered once
        for start in starts:
            logits = project(flat[start:start + size]).float()
            scores[start:start + size, 0] = logits.argmax(-1).float()
            scores[start:start + size, 1] = F.cross_entropy(logits, targets[start:start + size],
                                                            ignore_index=IGNORE_INDEX, reduction="none")
    return scores.view(*labels.shape, 2)


def _finish(owner: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    call = owner._vlm_pack_calls.pop() if owner._vlm_pack_calls else None
    if call is None:
        return None
    call.handle.remove()
    if output is None:  # the forward raised; the hook ran only to clean up
        return None
    if call.hidden is None:
        raise RuntimeError(f"{type(owner).__name__}'s forward never called its LM head: vlm_pack's chunked loss "
                           "cannot apply; pass enable_packing(model, chunked_loss=False)")
    if not isinstance(output, transformers.utils.ModelOutput):
        raise ValueError(f"{type(owner).__name__} returned a tuple (return_dict=False): vlm_pack's chunked loss "
                         "returns a ModelOutput; call the model with return_dict=True")
    head = LMHead(owner.get_output_embeddings(), **owner._vlm_pack_logit_transform)
    chunk = owner._vlm_pack_chunk_tokens
    fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    loss, logits = None, DeferredLogits(call.hidden, head, chunk)
    if call.targets is not None:  # inside the forward: a ZeRO-3-partitioned head is gathered here (core.zero3)
        loss = hidden_weighted_loss(call.hidden, head, call.targets, chunk_tokens=chunk)
    elif call.labels is not None:
        targets = row_targets(call.labels)
        if call.score:
            logits = slot_scores(call.hidden, head, call.labels, chunk)
            total = logits[..., 1].sum()
        else:
            total = hidden_weighted_loss(call.hidden, head, targets, chunk_tokens=chunk)
        count = (targets != IGNORE_INDEX).sum().clamp(min=1) if call.num_items is None else call.num_items
        loss = total / (count.to(total.device) if torch.is_tensor(count) else count)
        aux = output.get("aux_loss")
        if aux is not None:
            coefficient = getattr(owner, "router_aux_loss_coef", None)
            if coefficient is None:
                coefficient = text_config(owner.config).router_aux_loss_coef
            loss = loss + coefficient * aux.to(loss.device)
    return type(output)(loss=loss, logits=logits, **fields)


def install_hidden_loss(model: torch.nn.Module, chunk_tokens: int | None = None) -> bool:
    """Install the hooks (module docstring) on ``model``'s loss owner once; ``chunk_tokens`` slots per chunk (None:
    :data:`~vlm_pack.core.chunked_loss.DEFAULT_CHUNK_BYTES` of logits). False when ``model`` has no LM head."""
    owner = loss_owner(model)
    if owner is None:
        return False
    owner._vlm_pack_logit_transform = _logit_transform(owner)
    owner._vlm_pack_chunk_tokens = chunk_tokens
    if getattr(owner, "_vlm_pack_loss_hooks", None) is None:
        owner._vlm_pack_calls = []
        owner._vlm_pack_loss_hooks = (
            owner.register_forward_pre_hook(_arm, with_kwargs=True),
            owner.register_forward_hook(_finish, with_kwargs=True, always_call=True),
        )
    return True


def score_slots_in_evaluation(model: torch.nn.Module) -> bool:
    """Evaluation forwards with labels return :func:`slot_scores` as ``logits`` (for ``PackedEvaluation``); False
    when ``model`` carries no chunked-loss hooks (its logits then stay full)."""
    owner = loss_owner(model)
    if owner is None or getattr(owner, "_vlm_pack_loss_hooks", None) is None:
        return False
    owner._vlm_pack_score_slots = True
    return True
