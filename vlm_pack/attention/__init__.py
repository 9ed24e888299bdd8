"""Attention layer: how a packed row's samples are kept apart inside attention-like kernels.

``varlen`` routes one THD call to flash-attn, TransformerEngine, torch's varlen kernel, FlexAttention or the
exact per-segment SDPA path (chosen by device, dtype and what is installed); ``packed_layers`` gives recurrent
layers vlm_pack's own packed forwards, computed from their parameters, that restart the conv window and recurrent
state at each boundary (``gated_deltanet``: Qwen3.5, Qwen3-Next; ``short_conv``: LFM2; ``mamba2``: NemotronH;
shared plumbing in ``linear``); ``shared_prefix`` lets
several completions attend to one shared prompt (preference and RL paths); ``cross`` keeps each sample's text
attending to its own media keys in cross-attention layers (Mllama).

Imports: ``vlm_pack.core`` only (and optional kernels detected at run time). Model families (``vlm_pack.models``)
and everything above choose among these rules; nothing here knows a model family.
"""
