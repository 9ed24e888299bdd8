"""``PackedDPOTrainer``: TRL's ``DPOTrainer`` on packed preference rows, through its documented hooks only.

TRL 1.16 computes the DPO loss inside ``compute_loss`` from a padded ``[chosen; rejected]`` batch. This subclass
overrides ``compute_loss`` and ``compute_ref_log_probs`` (both public ``DPOTrainer`` methods): one forward of the
packed row (``PreferenceCollator``) per model, through TRL's own fused LM head with pre-shifted labels, gives every
sequence's summed completion log-prob (:func:`sequence_logps`); the loss is the TRL loss type of those sums
(``vlm_pack.preference.losses``), averaged over the micro-batch's pairs like TRL (Trainer then divides by the
gradient-accumulation steps: DPO batches carry no ``labels``, so no ``num_items_in_batch``). Precomputed reference
log-probs (``precompute_ref_log_probs=True``) go through the same packed forward. Dataset preparation, the
reference model, PEFT adapters and the metrics' names stay TRL's.

Over-long pairs (``max_length``, default 1024): truncated like TRL (``truncation_mode``; the collator's rule) or,
with ``overlong="drop"``, dropped from the dataset and counted (``overlong_dropped``). Both are decided when the
trainer is built: every example carries its dataset row (``ROW_KEY``), one pass over the lengths drops pairs or
names the first row that cannot be truncated (an IterableDataset: dropped lazily / named at its batch).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

import datasets
import torch
from accelerate.utils import is_peft_model
from trl import DPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ..core.batch import METADATA_KEY
from ..integrations.fused_tiles import FusedTiles, fused_tiles
from ..integrations.hf_model import enable_packing, keep_batches_whole, refuse_dispatch
from ..models import get_family, require_proven
from .collator import OVERLONG, PREFERENCE_KEY, ROW_KEY, PreferenceCollator
from .losses import PairLogps, check_dpo_options, dpo_loss

__all__ = ["PackedDPOTrainer", "sequence_logps"]

_BOOKKEEPING = {METADATA_KEY, "ref_chosen_logps", "ref_rejected_logps", "completion_mask"}
logger = logging.getLogger(__name__)


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


def _enable(model, collator: PreferenceCollator) -> None:
    """Packed attention on ``model`` once its family is proven on the collator's DPO layout (``vlm_pack.models``)."""
    model = model.get_base_model() if is_peft_model(model) else model
    path = "dpo_shared_prompt" if collator.shared_prompts else "dpo"
    family = get_family(model.config, allow_unproven=collator.allow_unproven)
    require_proven(family, path, "PackedDPOTrainer", allow_unproven=collator.allow_unproven)
    enable_packing(model, allow_unproven=collator.allow_unproven)


class PackedDPOTrainer(FusedTiles, DPOTrainer):
    """``trl.DPOTrainer`` whose batches are packed rows from :class:`PreferenceCollator`.

    Takes ``DPOTrainer``'s arguments; ``data_collator`` must be a ``PreferenceCollator`` (it adopts
    ``args.max_length`` and ``args.truncation_mode`` when it has no ``max_length``). ``overlong``: ``"truncate"``
    (TRL's behaviour, the default) or ``"drop"`` (pairs longer than ``max_length`` leave the dataset); sets the
    collator's. ``overlong_dropped``: pairs removed for their length, per dataset name (TRL's own filter of text
    pairs whose prompt fills ``max_length`` under keep_start included). The policy and the reference model are switched
    to packed attention (``vlm_pack.enable_packing``). Refused clearly: loss types or options that are not
    functions of sequence log-probs (``vlm_pack.preference.losses``), MoE auxiliary losses,
    ``return_outputs=True`` (the fused head builds no logits).
    ``last_logps``: the last micro-batch's per-pair :class:`PairLogps` (detached), for inspection.
    TRL's fused head runs in smaller tiles (:mod:`vlm_pack.integrations.fused_tiles`).
    """

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 *pargs, overlong: str | None = None, **kwargs) -> None:
        if not isinstance(data_collator, PreferenceCollator):
            raise ValueError("PackedDPOTrainer needs data_collator=vlm_pack.preference.PreferenceCollator(...); got "
                             f"{type(data_collator).__name__}")
        if overlong is not None:
            if overlong not in OVERLONG:
                raise ValueError(f"overlong={overlong!r}; choose 'truncate' (like TRL) or 'drop' (dropped, counted)")
            data_collator.overlong = overlong
        self._packed_collator = data_collator
        self.overlong_dropped: dict[str, int] = {}
        refuse_dispatch(args, "PackedDPOTrainer")
        if args is not None:
            check_dpo_options(args)
            self._adopt_length(args)
            if args.precompute_ref_log_probs and isinstance(model, str):
                raise ValueError("precompute_ref_log_probs=True with a model name: pass the loaded model, so packed "
                                 "attention is on before TRL precomputes the reference log-probs")
        # Packed attention before TRL's __init__, which may already run the reference (precompute_ref_log_probs).
        for candidate in (model, ref_model):
            if candidate is not None and not isinstance(candidate, str):
                _enable(candidate, data_collator)
        train_dataset = _with_rows(train_dataset)
        eval_dataset = ({k: _with_rows(v) for k, v in eval_dataset.items()} if isinstance(eval_dataset, dict)
                        else _with_rows(eval_dataset))
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, *pargs, **kwargs)
        keep_batches_whole(self)
        check_dpo_options(self.args)
        self._adopt_length(self.args)
        if self._is_vision_dataset:  # TRL prepares no vision dataset (_prepare_dataset is not called)
            self.train_dataset = self._check_overlong(self.train_dataset, "train")
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._check_overlong(v, k) for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self._check_overlong(self.eval_dataset, "eval")
        if self.aux_loss_enabled:
            raise ValueError("MoE router auxiliary loss (router_aux_loss_coef) is not supported by the packed DPO path")
        for candidate in (self.model, self.ref_model):  # models TRL loaded or created itself
            if candidate is not None:
                _enable(self.accelerator.unwrap_model(candidate), data_collator)
        self.last_logps: PairLogps | None = None

    def _adopt_length(self, args) -> None:
        """The collator takes ``args.max_length`` / ``truncation_mode`` unless it was given a ``max_length``."""
        collator = self._packed_collator
        if collator.max_length is None and args.max_length is not None:
            collator.max_length, collator.truncation_mode = args.max_length, args.truncation_mode
        collator.check_truncation()

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's preparation (tokenising; it drops text pairs whose prompt fills ``max_length`` under keep_start),
        then the over-long check of :meth:`_check_overlong` (before any reference log-prob is precomputed)."""
        before = len(dataset) if isinstance(dataset, datasets.Dataset) else None
        dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if before is not None and len(dataset) < before:  # TRL's own length filter: counted with ours
            self.overlong_dropped[dataset_name] = before - len(dataset)
        self._adopt_length(args)
        return self._check_overlong(dataset, dataset_name)

    def _check_overlong(self, dataset, name: str):
        """Drop (``overlong="drop"``, counted) or refuse (naming the dataset row) pairs longer than ``max_length``
        that the collator cannot truncate like TRL; one pass over the lengths (an IterableDataset: lazily)."""
        collator = self._packed_collator
        if collator.max_length is None or dataset is None:
            return dataset
        if isinstance(dataset, datasets.IterableDataset):
            if collator.overlong == "drop":
                self.overlong_dropped.setdefault(name, 0)

                def fits(example) -> bool:
                    keep = collator.overlong_problem(*collator.sequence_lengths(example)) is None
                    self.overlong_dropped[name] += not keep
                    return keep

                return dataset.filter(fits)
            return dataset  # truncated by the collator, whose errors name the row
        lengths = _pair_lengths(dataset, collator)
        rows = dataset[ROW_KEY] if ROW_KEY in dataset.column_names else list(range(len(dataset)))
        problems = [(i, problem) for i, length in enumerate(lengths)
                    if (problem := collator.overlong_problem(*length)) is not None]
        if collator.overlong == "drop":
            self.overlong_dropped[name] = self.overlong_dropped.get(name, 0) + len(problems)
            if problems:
                logger.warning("%s: dropped %d of %d preference pairs longer than max_length=%d (overlong='drop')",
                               name, len(problems), len(dataset), collator.max_length)
                dropped = {i for i, _ in problems}
                dataset = dataset.select([i for i in range(len(dataset)) if i not in dropped])
            return dataset
        if problems:
            i, problem = problems[0]
            raise ValueError(f"{name} dataset row {rows[i]}: {problem} ({len(problems)} such pairs); raise "
                             "max_length or pass overlong='drop' to drop and count them")
        longer = sum(prompt + max(chosen, rejected) > collator.max_length for prompt, chosen, rejected in lengths)
        if longer:
            logger.info("%s: %d of %d preference pairs are longer than max_length=%d and are truncated (%s), as "
                        "TRL does", name, longer, len(dataset), collator.max_length, collator.truncation_mode)
        return dataset

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if ROW_KEY not in self._signature_columns:  # the row index survives remove_unused_columns
            self._signature_columns = [*self._signature_columns, ROW_KEY]

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
        with torch.no_grad(), self.compute_loss_context_manager(), fused_tiles():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


def _with_rows(dataset):
    """``dataset`` with every example's row index under ``ROW_KEY`` (errors name the row the user gave)."""
    if isinstance(dataset, datasets.Dataset) and ROW_KEY not in dataset.column_names:
        return dataset.add_column(ROW_KEY, np.arange(len(dataset)))
    if isinstance(dataset, datasets.IterableDataset):
        return dataset.map(lambda example, row: {ROW_KEY: row}, with_indices=True)
    return dataset


def _pair_lengths(dataset, collator: PreferenceCollator) -> list[tuple[int, int, int]]:
    """Untruncated ``(prompt, chosen, rejected)`` token counts of every row: from the arrow list lengths of a
    tokenised dataset, else by encoding each raw (vision) example."""
    if "prompt_ids" in dataset.column_names:
        import pyarrow.compute as pc

        table = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).with_format("arrow")[:]
        columns = [pc.list_value_length(table[key]).to_numpy(zero_copy_only=False).tolist()
                   for key in ("prompt_ids", "chosen_ids", "rejected_ids")]
        return list(zip(*columns))
    return [collator.sequence_lengths(example) for example in dataset]
