"""DPO loss types of TRL 1.16 that depend on sequence-level quantities only (summed log-probs, completion lengths).

Each is written from its paper's formula (references in ``LOSS_TYPES``), with TRL 1.16's conventions where TRL
fixes one (IPO and ``sigmoid_norm`` normalise by completion length, ``sft`` is the token mean of the chosen
log-probs, ``aot`` sorts within the micro-batch). Loss types that need per-token weights (WPO ``use_weighting``,
LD-DPO ``ld_alpha``) are not sequence-level and are refused by ``check_dpo_options``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LOSS_TYPES", "PairLogps", "check_dpo_options", "dpo_loss", "f_divergence_scores"]

LOSS_TYPES = {
    "sigmoid": "DPO, arXiv 2305.18290",
    "hinge": "SLiC, arXiv 2305.10425",
    "ipo": "IPO, arXiv 2310.12036 (per-token average of the log-ratios)",
    "exo_pair": "EXO, arXiv 2402.00856",
    "nca_pair": "NCA, arXiv 2402.05369",
    "robust": "rDPO, arXiv 2403.00409",
    "bco_pair": "BCO, arXiv 2404.04656",
    "sppo_hard": "SPPO, arXiv 2405.00675 (hard labels)",
    "aot": "AOT, arXiv 2406.05882",
    "aot_unpaired": "AOT unpaired, arXiv 2406.05882",
    "apo_zero": "APO-zero, arXiv 2408.06266",
    "apo_down": "APO-down, arXiv 2408.06266",
    "discopop": "DiscoPOP, arXiv 2406.08414",
    "sft": "negative log-likelihood of the chosen completions (token mean)",
    "sigmoid_norm": "DPO on per-token averaged log-ratios",
}


@dataclass
class PairLogps:
    """Per-pair summed completion log-probs ``[P]`` of the policy and the reference, and completion lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def check_dpo_options(args) -> None:
    """Refuse DPOConfig options that are not functions of sequence log-probs (one clear error each)."""
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(
            f"loss_type {unknown} is not supported by the packed DPO path; supported: {sorted(LOSS_TYPES)}")
    if args.use_weighting:
        raise ValueError("use_weighting=True (WPO) needs per-token probability weights; the packed DPO path refuses it")
    if args.ld_alpha is not None:
        raise ValueError("ld_alpha (LD-DPO) splits each completion per token; the packed DPO path refuses it")


def f_divergence_scores(logratios: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """f'(ratio) of the f-DPO paper (arXiv 2309.16240) as a function of the log-ratio."""
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence":
        limit = {torch.float16: 11.0, torch.bfloat16: 80.0}.get(logratios.dtype, 80.0)
        scaled = torch.clamp(((alpha - 1.0) * logratios).float(), max=limit)
        return (torch.exp(scaled) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {kind!r}")


def dpo_loss(logps: PairLogps, loss_types: list[str], weights: list[float], *, beta: float,
             label_smoothing: float = 0.0, f_divergence: str = "reverse_kl", f_alpha: float = 1.0,
             discopop_tau: float = 0.05) -> torch.Tensor:
    """The micro-batch loss: ``sum_k weight_k * mean over pairs of loss_k`` (TRL 1.16's reduction)."""
    chosen_lr = logps.chosen - logps.ref_chosen
    rejected_lr = logps.rejected - logps.ref_rejected
    chosen_s = f_divergence_scores(chosen_lr, f_divergence, f_alpha)
    rejected_s = f_divergence_scores(rejected_lr, f_divergence, f_alpha)
    margin = beta * (chosen_s - rejected_s)
    chosen_len = logps.chosen_tokens.clamp(min=1).to(chosen_s.dtype)
    rejected_len = logps.rejected_tokens.clamp(min=1).to(chosen_s.dtype)
    total = 0.0
    for kind, weight in zip(loss_types, weights, strict=True):
        if kind == "sigmoid":
            loss = -F.logsigmoid(margin)
        elif kind == "hinge":
            loss = torch.relu(1 - margin)
        elif kind == "ipo":
            loss = (chosen_s / chosen_len - rejected_s / rejected_len - 1 / (2 * beta)) ** 2
        elif kind == "exo_pair":
            eps = torch.tensor(label_smoothing, device=margin.device)
            loss = (torch.sigmoid(margin) * (F.logsigmoid(margin) - torch.log1p(-eps))
                    + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - torch.log(eps)))
        elif kind == "nca_pair":
            loss = (-F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr)
                    - 0.5 * F.logsigmoid(-beta * rejected_lr))
        elif kind == "robust":
            loss = ((1 - label_smoothing) * -F.logsigmoid(margin) - label_smoothing * -F.logsigmoid(-margin)) / (
                1 - 2 * label_smoothing)
        elif kind == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif kind == "sppo_hard":
            loss = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif kind in ("aot", "aot_unpaired"):
            if kind == "aot":
                delta = (torch.sort(logps.chosen - logps.rejected).values
                         - torch.sort(logps.ref_chosen - logps.ref_rejected).values)
            else:
                delta = torch.sort(chosen_lr).values - torch.sort(rejected_lr).values
            loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                    - F.logsigmoid(-beta * delta) * label_smoothing)
        elif kind == "apo_zero":
            loss = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif kind == "apo_down":
            loss = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif kind == "discopop":
            mix = torch.sigmoid(margin / discopop_tau)
            loss = -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
        elif kind == "sft":
            loss = (-logps.chosen.sum() / logps.chosen_tokens.sum().clamp(min=1)).expand_as(margin)
        elif kind == "sigmoid_norm":
            loss = -F.logsigmoid(beta * (chosen_s / chosen_len - rejected_s / rejected_len))
        else:
            raise ValueError(f"unknown loss_type {kind!r}; supported: {sorted(LOSS_TYPES)}")
        total = total + loss.mean() * weight
    return total
