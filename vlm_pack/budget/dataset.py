"""Materialise token-budget packs lazily: item k renders, processes and packs the samples of pack k.

The work (image decoding, the processor, per-sample mRoPE positions) happens in ``__getitem__``, i.e. in the
DataLoader's workers. Each item is one packed row in the collator's contract, so a DataLoader runs at batch
size 1 with :meth:`TokenBudgetPackDataset.collate_fn` (which unwraps the single pack). Every sample's real
length is checked against the plan: a mismatch (stale plan, other processor settings) is an error naming the
sample, never a silent overflow.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from ..core.batch import packing_metadata
from .lengths import require_budget_proof
from .plan import TokenBudgetPlan

__all__ = ["TokenBudgetPackDataset"]


class TokenBudgetPackDataset(torch.utils.data.Dataset):
    """Pack ``k`` of ``plan`` built from ``examples`` by ``collator`` (a packing ``VLMPackingCollator``).

    ``fixed_width=True`` pads every row to ``plan.pack_size`` slots (one trailing fill segment): static shapes
    for CUDA graphs / compiled steps.
    """

    def __init__(self, examples: Sequence[Any], plan: TokenBudgetPlan, collator: Any, *,
                 fixed_width: bool = False) -> None:
        if len(examples) != plan.lengths.tokens.size:
            raise ValueError(
                f"the plan was made for {plan.lengths.tokens.size} samples but {len(examples)} examples were given: "
                "pass the same examples, in the same order, that were planned"
            )
        require_budget_proof(collator, "TokenBudgetPackDataset")
        if not collator.pack_sequences_in_batch:
            raise ValueError("the collator must pack (pack_sequences_in_batch=True) to build token-budget packs")
        if collator.pad_to_multiple_of != plan.pad_to_multiple_of:
            raise ValueError(
                f"the collator aligns samples to {collator.pad_to_multiple_of} but the plan to "
                f"{plan.pad_to_multiple_of}: use the same context/tensor-parallel layout for both"
            )
        if collator.max_length < plan.pack_size:
            raise ValueError(f"collator max_length={collator.max_length} < pack_size={plan.pack_size}: raise it")
        self._alone = collator  # each sample on its own, to name the one a failing pack trips on
        if fixed_width:
            collator = copy.copy(collator)
            collator.pad_to_length = plan.pack_size
        self.examples = examples
        self.plan = plan
        self.collator = collator

    def __len__(self) -> int:
        return self.plan.num_packs

    def __getitem__(self, k: int) -> dict[str, Any]:
        indices = self.plan.pack(k)
        try:
            batch = self.collator([self.examples[int(i)] for i in indices])
        except Exception as err:
            self._name_failing_sample(k, indices)
            raise ValueError(f"pack {k} (dataset samples {indices.tolist()}): {err}") from err
        real = torch.diff(packing_metadata(batch)["cu_seqlens"]).tolist()
        for index, got in zip(indices.tolist(), real):
            self._check_length(k, index, got)
        return batch

    def _check_length(self, k: int, index: int, got: int) -> None:
        want = int(self.plan.lengths.tokens[index])
        if got != want:
            raise ValueError(
                f"pack {k}: dataset sample {index} has {got} tokens but the plan says {want}. The plan is stale "
                "(examples, processor or chat template changed since planning): re-run the planning step."
            )

    def _name_failing_sample(self, k: int, indices: Any) -> None:
        """After pack ``k`` failed: encode its samples one by one and raise naming the dataset index of the first
        that fails alone or whose length differs from the plan (the collator only knows positions in the pack)."""
        for index in indices.tolist():
            try:
                got = self._alone([self.examples[index]])["input_ids"].shape[1]
            except Exception as err:
                reason = str(err).removeprefix("sample 0: ")
                raise ValueError(f"pack {k}: dataset sample {index}: {reason}") from err
            self._check_length(k, index, got)

    @staticmethod
    def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
        """DataLoader ``collate_fn`` at batch size 1: the pack is the batch."""
        if len(items) != 1:
            raise ValueError(
                f"token-budget packs are served at micro-batch size 1 (a pack is the batch); got {len(items)} "
                "items: set batch_size=1"
            )
        return items[0]
