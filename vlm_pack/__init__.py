"""vlm_pack: exact sequence packing for VLM and LLM fine-tuning.

The core (packing, metadata, config) imports eagerly and needs only torch/numpy; everything that pulls in
transformers or datasets (collator, HF integration, offline packing) loads on first use.
"""

from importlib import import_module
from typing import Any

from .config import PackedSequenceSpecs, PackingConfig
from .packed_seq_params import PackedSeqParams, get_packed_seq_params
from .packing import PackedBatch, pack_batch_sequences, pack_sequences, pad_multiple

__version__ = "0.1.0"

_LAZY = {
    "VLMPackingCollator": "collator",
    "CollatorStats": "collator",
    "model_inputs": "batch",
    "METADATA_KEY": "batch",
    "varlen_attention": "attention",
    "available_backends": "attention",
    "ATTN_IMPLEMENTATION": "hf",
    "enable_packing": "hf",
    "register_attention": "hf",
    "packed_cross_entropy": "loss",
    "shift_packed_labels": "loss",
    "partition_for_context_parallel": "context_parallel",
    "gather_from_context_parallel": "context_parallel",
    "BalancedPackingSampler": "distributed",
    "reduce_per_token_loss": "distributed",
    "reduce_per_sample_mean_loss": "distributed",
    "PackedSFTDataset": "offline",
    "PackedDataset": "offline",
    "prepare_packed_sequence_data": "offline",
}

__all__ = [
    "PackedBatch",
    "PackedSeqParams",
    "PackedSequenceSpecs",
    "PackingConfig",
    "get_packed_seq_params",
    "pack_batch_sequences",
    "pack_sequences",
    "pad_multiple",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vlm_pack' has no attribute {name!r}")
