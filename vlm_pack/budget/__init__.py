"""Token-budget packs for VLMs: fixed-size packs planned from EXACT per-sample token counts, built lazily.

In-batch packing concatenates a fixed number of samples, so a row's length (memory, step time) swings with the
data. Here every pack holds at most ``pack_size`` tokens, micro-batch 1, like the offline LLM path:

    examples --measure_lengths--> exact tokens per sample (text through the chat template and tokenizer; each
             image's token count from its header size through the processor's own resize rule; no pixels)
             --plan_token_budget_packs--> packs of <= pack_size tokens (offline bin-packing algorithms), ordered
             so the data-parallel ranks of one step get similar image-token loads; saved pickle-free
             --TokenBudgetPackDataset[k]--> the collator on pack k's samples: one packed row, same contract as
             in-batch packing (per-sample positions incl. mRoPE, vision tensors in sample order, cu_seq_lens)
"""


# Names load on first use: `vlm-pack plan-vlm --help` imports this package and must not load torch.
from ..lazy_exports import lazy_getattr

_LAZY = {
    "TokenBudgetPackDataset": "dataset",
    "SampleLengths": "lengths",
    "measure_lengths": "lengths",
    "TokenBudgetPlan": "plan",
    "plan_token_budget_packs": "plan",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
