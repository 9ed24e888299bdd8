"""``UlyssesTrainer``: Trainer under DeepSpeed Ulysses with the exact global token mean, and the setup checks.

Trainer's own Ulysses loss (``deepspeed_sp_compute_loss``) is each micro-batch's token mean, all-gathered with
autograd over the SP group; Trainer then divides by the accumulation steps and the engine averages over data-
parallel groups: a mean of per-pack means, not the token mean of the step (and it returns before
``compute_loss_func`` / ``num_items_in_batch``). Here the step's label tokens are counted once over every
micro-batch of the window on every rank (each rank holds its slice of ``shift_labels``, so the sum over all
processes counts every target once), and each rank's loss is ``its summed token CE * R / count``, where R is the
number of ranks the ZeRO-3 engine averages gradients over. The summed CE comes from this rank's hidden states, the
LM head applied in chunks at its target slots (vlm_pack.core.chunked_loss) inside the model's forward (where ZeRO-3
gathers the partitioned head once): no rank holds its slice's logits. After the engine's reduction the gradient is
that of ``sum of all token losses of the step / all its label tokens``.

Refused at construction, with the reason: no Ulysses ``parallelism_config``; torch / accelerate context
parallelism (``cp_size > 1``: ring SDPA takes no mask and accelerate forces ``is_causal``, so packed samples would
attend to each other); an attention that ignores packed boundaries (``sdpa``); ZeRO stages other than 3
(deepspeedai/DeepSpeed#5248: under sequence parallelism ZeRO-1/2 scale gradients differently from ZeRO-3; a
DeepSpeed config without ``zero_optimization`` is stage 0); accelerate counting fewer processes than
torch.distributed runs (on CPU without ``TrainingArguments(use_cpu=True)``: it counts one, and the gloo
all-gather of the step's token count failed inside ``get_batch_samples``); evaluation during training; a
micro-batch other than one packed row; a model that :func:`.model.prepare_model` did not prepare.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Trainer

from ..core.packing import IGNORE_INDEX
from ..integrations.head_loss import TARGETS_KWARG
from .model import SP_ATTN_IMPLEMENTATION

__all__ = ["UlyssesTrainer", "check_ulysses_arguments"]

BOUNDARY_AWARE = (SP_ATTN_IMPLEMENTATION, "flash_attention_2", "flash_attention_3")
"""Attention names that honour ``cu_seq_lens_*`` inside the Ulysses wrapper (flash-attn reads the same kwargs)."""


def _zero_stage(deepspeed: Any) -> Any:
    if isinstance(deepspeed, str):
        with open(deepspeed) as handle:
            deepspeed = json.load(handle)
    return (deepspeed or {}).get("zero_optimization", {}).get("stage", 0)


def check_ulysses_arguments(args: Any, model: Any) -> None:
    """Raise a one-line ValueError for every combination that cannot be exact (see the module docstring)."""
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and getattr(pc, "cp_size", 1) > 1:
        raise ValueError(
            f"context parallelism (cp_size={pc.cp_size}, torch/accelerate ring attention) cannot train packed rows: "
            "torch's ring SDPA rejects attention masks and accelerate's cp path drops the mask and forces is_causal, "
            "so packed samples attend to each other. Use sp_size with sp_backend='deepspeed' "
            "(vlm_pack.sequence_parallel)"
        )
    if pc is None or getattr(pc, "sp_size", 1) < 2 or pc.sp_backend != "deepspeed":
        raise ValueError(
            "UlyssesTrainer needs TrainingArguments(parallelism_config=ParallelismConfig(sp_size>=2, "
            "sp_backend='deepspeed', ...)): build it with vlm_pack.sequence_parallel.ulysses_setup"
        )
    implementation = pc.sp_handler.sp_attn_implementation
    if implementation not in BOUNDARY_AWARE:
        raise ValueError(
            f"sp_attn_implementation={implementation!r} ignores packed boundaries (samples of a row would attend to "
            f"each other): use {SP_ATTN_IMPLEMENTATION!r} (ulysses_setup sets it) or flash_attention_2/3"
        )
    if getattr(model, "_vlm_pack_sp_size", None) != pc.sp_size:
        raise ValueError(
            f"the model was not prepared for sp_size={pc.sp_size}: call vlm_pack.sequence_parallel.ulysses_setup "
            "(or prepare_model(model, sp_size)) before building the Trainer"
        )
    text_implementation = model.config.get_text_config()._attn_implementation
    if text_implementation != implementation:
        raise ValueError(
            f"the language model runs {text_implementation!r} but Ulysses wraps {implementation!r}: the two must match"
        )
    if args.deepspeed is None:
        raise ValueError("Ulysses sequence parallelism runs inside DeepSpeed: pass TrainingArguments(deepspeed="
                         "vlm_pack.sequence_parallel.zero3_config())")
    stage = _zero_stage(args.deepspeed)
    if stage != 3:
        raise ValueError(
            f"ZeRO stage {stage} under sequence parallelism is refused: ZeRO-0/1/2 reduce gradients with another "
            "scale than ZeRO-3 under Ulysses (deepspeedai/DeepSpeed#5248), so the loss would be off by the SP size; "
            "use stage 3 (vlm_pack.sequence_parallel.zero3_config())"
        )
    evaluation = getattr(args, "eval_strategy", "no")
    if getattr(evaluation, "value", evaluation) != "no":
        raise ValueError(
            "evaluation under sequence parallelism is not supported (eval batches do not pass through DeepSpeed's "
            "Ulysses adapter): set eval_strategy='no' and evaluate the saved model without SP"
        )
    if args.per_device_train_batch_size != 1:
        raise ValueError(
            f"per_device_train_batch_size={args.per_device_train_batch_size}: Ulysses takes ONE packed row per "
            "micro-batch; set 1 and pack several examples per row (grouped_rows, offline or token-budget packs)"
        )


class UlyssesTrainer(Trainer):
    """``transformers.Trainer`` for packed rows under DeepSpeed Ulysses: exact global token mean (see module)."""

    loss_is_scaled_for_ga = True  # the loss below is already divided by the whole step's token count

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_ulysses_arguments(self.args, self.model)
        if dist.is_initialized() and self.accelerator.num_processes != dist.get_world_size():
            # measured on CPU with use_cpu=False: accelerate counts 1 of 2 processes; even with the token count
            # all-reduced directly the update is off by 0.80 (relative L2), so this is refused, not patched
            raise ValueError(
                f"accelerate counts {self.accelerator.num_processes} process(es) but torch.distributed runs "
                f"{dist.get_world_size()}, so the step's token count cannot be gathered across ranks: on CPU pass "
                "TrainingArguments(use_cpu=True)"
            )
        import deepspeed

        if not deepspeed.comm.is_initialized():  # accelerate builds the SP groups before DeepSpeed's own init
            deepspeed.init_distributed(dist_backend=dist.get_backend())

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The window's micro-batches and the label-token count of the whole step (all ranks, all micro-batches)."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum(int((batch["shift_labels"] != IGNORE_INDEX).sum()) for batch in batches)
        total = torch.tensor(count, dtype=torch.long, device=device)
        if dist.is_initialized():
            total = self.accelerator.gather(total.reshape(1)).sum()
        return batches, total

    def _averaging_ranks(self) -> int:
        """How many ranks the ZeRO-3 engine averages each gradient over (measured: the sequence-data-parallel
        world; tests/test_multiprocess.py checks the resulting gradients)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None:
            raise ValueError("UlyssesTrainer got no token count for the step (its get_batch_samples was bypassed)")
        targets = inputs.pop("shift_labels")
        inputs.pop("labels", None)
        # the summed CE of this rank's slice, formed inside the forward (the head in chunks, never T/R x V; under
        # ZeRO-3 the forward is where DeepSpeed gathers the partitioned head, and again for the backward)
        outputs = model(**inputs, use_cache=False, **{TARGETS_KWARG: targets})
        total = outputs.loss
        if total is None:  # a peer's fused forward (Liger, Cut Cross-Entropy) left the logits whole
            logits = outputs.logits
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                    targets.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = total * self._averaging_ranks() / num_items_in_batch.to(total.device).clamp(min=1)
        return (loss, outputs) if return_outputs else loss
