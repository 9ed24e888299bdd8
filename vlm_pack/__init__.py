"""vlm_pack: exact sequence packing for VLM and LLM fine-tuning.

Every name loads on first use: ``import vlm_pack`` stays cheap, and the torch-free parts (offline
``prepare`` on a warm cache, ``verify``) never import torch.
"""


__version__ = "0.1.0"

from .lazy_exports import lazy_getattr

_LAZY = {
    "PackedSequenceSpecs": "config",
    "PackingConfig": "config",
    "PackedSeqParams": "packed_seq_params",
    "get_packed_seq_params": "packed_seq_params",
    "PackedBatch": "packing",
    "pack_batch_sequences": "packing",
    "pack_sequences": "packing",
    "pad_multiple": "packing",
    "VLMPackingCollator": "collator",
    "CollatorStats": "collator",
    "model_inputs": "batch",
    "compute_loss_func": "hf_trainer",
    "SampleMeanLoss": "hf_trainer",
    "PackedEvaluation": "hf_eval",
    "SamplePrediction": "hf_eval",
    "split_predictions": "hf_eval",
    "PackedSFTTrainer": "hf_trl",
    "to_hf_dataset": "hf_datasets",
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
    "BalancedBatchSampler": "hf_sampler",
    "reduce_per_token_loss": "distributed",
    "reduce_per_sample_mean_loss": "distributed",
    "PackedSFTDataset": "offline",
    "PackedDataset": "offline",
    "prepare_packed_sequence_data": "offline",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
