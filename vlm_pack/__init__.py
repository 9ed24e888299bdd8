"""vlm_pack: exact sequence packing for VLM and LLM fine-tuning.

Every name loads on first use: ``import vlm_pack`` stays cheap, and the torch-free parts (offline
``prepare`` on a warm cache, ``verify``) never import torch.
"""


__version__ = "0.1.0"

from .core.versions import check_supported
from .lazy_exports import lazy_getattr

check_supported()  # torch / transformers older than the supported range: a clear ImportError naming the release

_LAZY = {
    "PackedSequenceSpecs": "core.config",
    "PackingConfig": "core.config",
    "PackedSeqParams": "core.packed_seq_params",
    "get_packed_seq_params": "core.packed_seq_params",
    "PackedBatch": "core.packing",
    "pack_batch_sequences": "core.packing",
    "pack_sequences": "core.packing",
    "pad_multiple": "core.packing",
    "VLMPackingCollator": "data.collator",
    "CollatorStats": "data.collator",
    "model_inputs": "core.batch",
    "compute_loss_func": "integrations.trainer",
    "SampleMeanLoss": "integrations.trainer",
    "PackedEvaluation": "integrations.evaluation",
    "SamplePrediction": "integrations.evaluation",
    "split_predictions": "integrations.evaluation",
    "PackedSFTTrainer": "integrations.sft_trainer",
    "PackedGRPOTrainer": "rl.trainers",
    "to_hf_dataset": "offline.hf_view",
    "METADATA_KEY": "core.batch",
    "varlen_attention": "attention.varlen",
    "available_backends": "attention.varlen",
    "ATTN_IMPLEMENTATION": "integrations.hf_model",
    "enable_packing": "integrations.hf_model",
    "register_attention": "integrations.hf_model",
    "packed_cross_entropy": "core.loss",
    "shift_packed_labels": "core.loss",
    "partition_for_context_parallel": "core.context_parallel",
    "gather_from_context_parallel": "core.context_parallel",
    "BalancedPackingSampler": "core.distributed",
    "BalancedBatchSampler": "integrations.sampler",
    "reduce_per_token_loss": "core.distributed",
    "reduce_per_sample_mean_loss": "core.distributed",
    "PackedSFTDataset": "offline",
    "PackedDataset": "offline",
    "prepare_packed_sequence_data": "offline",
    "StreamingPackDataset": "streaming.dataset",
    "StreamingPackCallback": "streaming.trainer",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
