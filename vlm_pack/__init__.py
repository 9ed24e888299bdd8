"""vlm_pack: exact sequence packing for VLM and LLM fine-tuning."""

from .config import PackedSequenceSpecs, PackingConfig
from .packed_seq_params import PackedSeqParams, get_packed_seq_params
from .packing import PackedBatch, pack_batch_sequences, pad_multiple

__version__ = "0.1.0"

__all__ = [
    "PackedBatch",
    "PackedSeqParams",
    "PackedSequenceSpecs",
    "PackingConfig",
    "get_packed_seq_params",
    "pack_batch_sequences",
    "pad_multiple",
]
