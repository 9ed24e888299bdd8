"""``PackedDPOTrainer``: TRL's ``DPOTrainer`` on packed preference rows, through its documented hooks only.

TRL 1.16 computes the DPO loss inside ``compute_loss`` from a padded ``[chosen; rejected]`` batch. This subclass
overrides ``compute_loss`` and ``compute_ref_log_probs`` (both public ``DPOTrainer`` methods): one forward of the
packed row (``PreferenceCollator``) per model, through TRL's own fused LM head with pre-shifted labels, gives every
sequence's summed completion log-prob (:func:`sequence_logps`); the loss is the TRL loss type of those sums
(``vlm_pack.preference.losses``), averaged over the micro-batch's pairs like TRL (Trainer then divides by the
gradient-accumulation steps: DPO batches carry no ``labels``, so no ``num_items_in_batch``). Precomputed reference
log-probs (``precompute_ref_log_probs=True``) go through the same packed forward. Dataset preparation, the
reference model, PEFT adapters and the metrics' names stay TRL's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import DPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ..core.batch import METADATA_KEY
from ..integrations.hf_model import enable_packing
from .collator import PREFERENCE_KEY, PreferenceCollator
from .losses import PairLogps, check_dpo_options, dpo_loss

__all__ = ["PackedDPOTrainer", "sequence_logps"]

_BOOKKEEPING = {METADATA_KEY, "ref_chosen_logps", "ref_rejected_logps", "completion_mask"}


def _layout(inputs: dict[str, Any]) -> dict[str, Any]:
    layout = (inputs.get(METADATA_KEY) or {}).get(PREFERENCE_KEY)
    if layout is None:
        raise ValueError(
            "the batch holds no packed preference layout (batch['vlm_pack']['preference']): pass "
            "data_collator=vlm_pack.preference.PreferenceCollator(...) to the packed trainer"
        )
    return layout


def sequence_logps(model: torch.nn.Module, inputs: dict[str, Any], **extra: Any) -> tuple[torch.Tensor, Any]:
    """Per-sequence summed completion log-probs ``[2P]`` (``2 i`` chosen, ``2 i + 1`` rejected) of a packed batch.

    ``model`` must carry TRL's fused LM head (``DPOTrainer`` adds it); returns ``(logps, fused outputs)``.
    """
    layout = _layout(inputs)
    kwargs = {key: value for key, value in inputs.items() if key not in _BOOKKEEPING}
    outputs = model(**kwargs, **extra, use_cache=False, shift_labels=layout["shift_labels"], fused_lm_head=True)
    per_slot = outputs.log_probs.reshape(-1)
    which = layout["sequence_of_target"].to(per_slot.device)
    sequences = 2 * int(layout["pairs"])
    sums = per_slot.new_zeros(sequences + 1).index_add(0, torch.where(which >= 0, which, sequences), per_slot)
    return sums[:sequences], outputs


def _enable(model) -> None:
    enable_packing(model.get_base_model() if is_peft_model(model) else model)


class PackedDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` whose batches are packed rows from :class:`PreferenceCollator`.

    Takes ``DPOTrainer``'s arguments; ``data_collator`` must be a ``PreferenceCollator`` (it adopts
    ``args.max_length`` when it has none: a longer pair raises where TRL would truncate it). The policy and the
    reference model are switched to packed attention (``vlm_pack.enable_packing``). Refused clearly: loss types
    or options that are not functions of sequence log-probs (``vlm_pack.preference.losses``), MoE auxiliary
    losses, ``return_outputs=True`` (the fused head builds no logits).
    ``last_logps``: the last micro-batch's per-pair :class:`PairLogps` (detached), for inspection.
    """

    def __init__(self, model, ref_model=None, args=None, data_collator=None, *pargs, **kwargs) -> None:
        if not isinstance(data_collator, PreferenceCollator):
            raise ValueError("PackedDPOTrainer needs data_collator=vlm_pack.preference.PreferenceCollator(...); got "
                             f"{type(data_collator).__name__}")
        if args is not None:
            check_dpo_options(args)
            if data_collator.max_length is None:  # TRL's collators truncate at max_length; ours refuses longer pairs
                data_collator.max_length = args.max_length
            if args.precompute_ref_log_probs and isinstance(model, str):
                raise ValueError("precompute_ref_log_probs=True with a model name: pass the loaded model, so packed "
                                 "attention is on before TRL precomputes the reference log-probs")
        # Packed attention before TRL's __init__, which may already run the reference (precompute_ref_log_probs).
        for candidate in (model, ref_model):
            if candidate is not None and not isinstance(candidate, str):
                _enable(candidate)
        super().__init__(model, ref_model, args, data_collator, *pargs, **kwargs)
        check_dpo_options(self.args)
        if data_collator.max_length is None:
            data_collator.max_length = self.args.max_length
        if self.aux_loss_enabled:
            raise ValueError("MoE router auxiliary loss (router_aux_loss_coef) is not supported by the packed DPO path")
        for candidate in (self.model, self.ref_model):  # models TRL loaded or created itself
            if candidate is not None:
                _enable(self.accelerator.unwrap_model(candidate))
        self.last_logps: PairLogps | None = None

    def _reference_context(self):
        """TRL's PEFT rule: without a reference model, the reference is the adapter-free (or 'ref' adapter) model."""
        if self.ref_model is None and is_peft_model(self.model):
            unwrapped = self.accelerator.unwrap_model(self.model)
            return use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        return contextlib.nullcontext()

    def compute_ref_log_probs(self, model, inputs):
        """Reference log-probs ``(chosen [P], rejected [P])`` of one packed batch (also used for precomputing)."""
        with (torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
              self._reference_context(), self.accelerator.autocast()):
            logps, _ = sequence_logps(model, inputs)
        return logps[0::2], logps[1::2]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("PackedDPOTrainer computes no logits (TRL's fused LM head): return_outputs=True is "
                             "refused")
        mode = "train" if self.model.training else "eval"
        layout = _layout(inputs)
        logps, outputs = sequence_logps(model, inputs)
        if self.precompute_ref_logps:
            if "ref_chosen_logps" not in layout:
                raise ValueError("precompute_ref_log_probs=True but the batch carries no ref_chosen_logps")
            ref_chosen, ref_rejected = layout["ref_chosen_logps"], layout["ref_rejected_logps"]
        else:
            ref_chosen, ref_rejected = self.compute_ref_log_probs(self.ref_model or self.model, inputs)
        lengths = layout["completion_lengths"].to(logps.device)
        pair = PairLogps(logps[0::2], logps[1::2], ref_chosen.to(logps.device), ref_rejected.to(logps.device),
                         lengths[0::2], lengths[1::2])
        loss = dpo_loss(
            pair, self.loss_types, self.loss_weights, beta=self.beta, label_smoothing=self.label_smoothing,
            f_divergence=self.f_divergence_type, f_alpha=self.f_alpha_divergence_coef,
            discopop_tau=self.args.discopop_tau,
        )
        self.last_logps = PairLogps(*(t.detach() for t in vars(pair).values()))
        self._log_metrics(mode, pair, outputs, layout, inputs)
        return loss

    def _log_metrics(self, mode: str, pair: PairLogps, outputs, layout: dict[str, Any], inputs) -> None:
        """TRL's metric names: rewards, margins, accuracies, log-probs, and the token-level ones."""
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        chosen_rewards = self.beta * (pair.chosen - pair.ref_chosen).detach()
        rejected_rewards = self.beta * (pair.rejected - pair.ref_rejected).detach()
        metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(gather(pair.chosen.detach()).mean().item())
        metrics["logps/rejected"].append(gather(pair.rejected.detach()).mean().item())
        which = layout["sequence_of_target"].to(pair.chosen.device)
        chosen, rejected = (which >= 0) & (which % 2 == 0), (which >= 0) & (which % 2 == 1)
        totals = torch.stack([
            outputs.entropy.reshape(-1)[which >= 0].sum().detach(), (which >= 0).sum(),
            outputs.mean_logits.reshape(-1)[chosen].sum().detach(), chosen.sum(),
            outputs.mean_logits.reshape(-1)[rejected].sum().detach(), rejected.sum(),
            outputs.is_top1.reshape(-1)[chosen].sum(),
        ]).float()
        totals = gather(totals.unsqueeze(0)).sum(0).tolist()
        metrics["entropy"].append(totals[0] / totals[1] if totals[1] else 0.0)
        metrics["logits/chosen"].append(totals[2] / totals[3] if totals[3] else 0.0)
        metrics["logits/rejected"].append(totals[4] / totals[5] if totals[5] else 0.0)
        metrics["mean_token_accuracy"].append(totals[6] / totals[3] if totals[3] else 0.0)
        if mode == "train":
            self._total_train_tokens += int(gather(torch.tensor(inputs["input_ids"].numel())).sum()) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the packed loss only (no logits exist to return)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
