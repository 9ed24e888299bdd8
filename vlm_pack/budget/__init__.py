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

from .dataset import TokenBudgetPackDataset
from .lengths import SampleLengths, measure_lengths
from .plan import TokenBudgetPlan, plan_token_budget_packs

__all__ = ["SampleLengths", "TokenBudgetPackDataset", "TokenBudgetPlan", "measure_lengths", "plan_token_budget_packs"]
