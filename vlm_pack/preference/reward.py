"""Reward modelling on packed rows: TRL's ``RewardTrainer`` with every chosen and rejected sequence in one row.

A sequence-classification model (``AutoModelForSequenceClassification``) scores a sequence at its last token that
is not the pad token (transformers' pooling rule, which TRL's padded batches rely on). On a packed row the model's
own pooling would score the row's last token only, so ``PackedRewardTrainer.compute_loss`` (TRL's documented
hook) reads the per-token scores of the model's ``score`` head with a forward hook during the model's own forward
and takes each sequence's pooled slot from ``batch["vlm_pack"]["reward"]["score_index"]``. The pairwise loss,
margins, ``center_rewards_coefficient`` and metric names are TRL 1.16's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from trl import RewardTrainer

from ..core.batch import METADATA_KEY
from ..integrations.hf_model import enable_packing, keep_batches_whole, refuse_dispatch
from ..core.packing import pack_sequences
from ..models import get_family, require_proven

__all__ = ["PackedRewardTrainer", "RewardCollator", "sequence_scores"]

REWARD_KEY = "reward"


class RewardCollator:
    """TRL's tokenised reward pairs (``chosen_ids`` / ``rejected_ids``, optional ``margin``) -> one packed row.

    Row order: pair by pair, chosen then rejected; positions restart at 0 per sequence. ``pad_token_id``: the
    tokenizer's (``RewardTrainer`` copies it to ``model.config``); it decides each sequence's pooled slot.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = int(pad_token_id)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise ValueError("empty batch: the collator got no reward pairs")
        sequences = []
        for index, example in enumerate(examples):
            for key in ("chosen_ids", "rejected_ids"):
                if key not in example or len(example[key]) == 0:
                    raise ValueError(f"example {index}: needs a non-empty {key!r} (TRL's tokenised reward format)")
                sequences.append(torch.as_tensor(example[key], dtype=torch.long))
        packed = pack_sequences(sequences, pad_token_id=self.pad_token_id)
        starts = np.concatenate([[0], np.cumsum([len(s) for s in sequences])])
        score_index = []
        for start, seq in zip(starts[:-1], sequences):
            real = np.flatnonzero(seq.numpy() != self.pad_token_id)
            score_index.append(start + (int(real[-1]) if real.size else 0))  # transformers: argmax over 0 -> 0
        layout: dict[str, Any] = {"score_index": torch.tensor(score_index)}
        if "margin" in examples[0]:
            layout["margin"] = torch.tensor([float(example["margin"]) for example in examples])
        batch: dict[str, Any] = {"input_ids": packed.tokens, "position_ids": packed.position_ids,
                                 **packed.attention_kwargs()}
        batch[METADATA_KEY] = {"cu_seqlens": packed.cu_seqlens, "cu_seqlens_padded": packed.cu_seqlens_padded,
                               "seq_lengths": packed.seq_lengths, REWARD_KEY: layout}
        return batch


def _score_head(model: torch.nn.Module) -> torch.nn.Module:
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no 'score' head: pass an AutoModelForSequenceClassification model")
    return head


def sequence_scores(
    model: torch.nn.Module, inputs: dict[str, Any], head: torch.nn.Module | None = None
) -> torch.Tensor:
    """Per-sequence scores ``[2P, num_labels]`` (``2 i`` chosen, ``2 i + 1`` rejected) of a packed reward batch.

    ``head``: the score module of ``model`` (default ``model.score``; pass it when ``model`` is a wrapper).
    """
    layout = (inputs.get(METADATA_KEY) or {}).get(REWARD_KEY)
    if layout is None:
        raise ValueError("the batch holds no packed reward layout: pass data_collator=RewardCollator(...)")
    captured = []
    handle = (head or _score_head(model)).register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model(**{k: v for k, v in inputs.items() if k != METADATA_KEY}, use_cache=False)
    finally:
        handle.remove()
    per_token = captured[-1].reshape(-1, captured[-1].shape[-1])
    return per_token[layout["score_index"].to(per_token.device)]


class PackedRewardTrainer(RewardTrainer):
    """``trl.RewardTrainer`` on packed rows from :class:`RewardCollator` (same arguments otherwise).

    The model is switched to packed attention (``vlm_pack.enable_packing``) once its family is proven on reward
    modelling (``vlm_pack.models``; ``allow_unproven=True``: a warning instead of the refusal).
    """

    def __init__(self, model, args=None, data_collator=None, *pargs, allow_unproven: bool = False, **kwargs) -> None:
        if not isinstance(data_collator, RewardCollator):
            raise ValueError("PackedRewardTrainer needs data_collator=vlm_pack.preference.RewardCollator(pad_token_id)")
        refuse_dispatch(args, "PackedRewardTrainer")
        super().__init__(model, args, data_collator, *pargs, **kwargs)
        keep_batches_whole(self)
        unwrapped = self.accelerator.unwrap_model(self.model)
        family = get_family(unwrapped.config, allow_unproven=allow_unproven)
        require_proven(family, "reward", "PackedRewardTrainer", allow_unproven=allow_unproven)
        enable_packing(unwrapped, allow_unproven=allow_unproven)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("PackedRewardTrainer returns no padded logits; return_outputs=True is refused")
        mode = "train" if self.model.training else "eval"
        scores = sequence_scores(model, inputs, head=_score_head(self.accelerator.unwrap_model(model)))
        chosen, rejected = scores[0::2].squeeze(-1), scores[1::2].squeeze(-1)
        layout = inputs[METADATA_KEY][REWARD_KEY]
        margin = layout.get("margin")
        difference = chosen - rejected - (0.0 if margin is None else margin.to(chosen.device))
        loss = -F.logsigmoid(difference).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        if mode == "train":
            self._total_train_tokens += int(gather(torch.tensor(inputs["input_ids"].numel())).sum()) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        with torch.no_grad():
            everything = self.accelerator.gather(scores)
            metrics["min_reward"].append(everything.min().item())
            metrics["mean_reward"].append(everything.mean().item())
            metrics["max_reward"].append(everything.max().item())
            metrics["accuracy"].append(gather((chosen > rejected).float().mean()).mean().item())
            metrics["margin"].append(gather((chosen - rejected).mean()).mean().item())
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the packed loss only (no padded logits exist to return)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
