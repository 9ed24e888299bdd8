"""Core layer: the packed-row contract and everything that is pure arithmetic on it.

Packing a micro-batch into one row (``packing``), the batch a collator returns (``batch``), per-sample loss and
label shifting (``loss``), mRoPE positions per sample (``rope_index``), Megatron-Core metadata
(``packed_seq_params``), the zigzag context-parallel split (``context_parallel``), rank balancing and loss
reduction across ranks (``distributed``), the typed configuration (``config``) and the supported torch /
transformers releases (``versions``).

Imports: torch, numpy, packaging and the standard library only; nothing from another vlm_pack layer. Every other layer
builds on this one (core <- attention <- models <- data <- integrations <- paths <- cli).
"""
