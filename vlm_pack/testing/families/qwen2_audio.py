"""Tiny Qwen2-Audio (Whisper-style audio tower + Qwen2 text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import Builder, family_tokenizer, qwen2_text

__all__ = ["BUILDERS"]

# ---------------------------------------------------------------- Qwen2-Audio (Whisper-style audio tower + Qwen2 text)

_QWEN2_AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]


def _qwen2_audio_processor() -> ProcessorMixin:
    """The official template: ``Qwen2AudioProcessor.default_chat_template``, shipped in transformers (no generation
    blocks: the collator locates the assistant turns by rendering prefixes)."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    return Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=16),
                               tokenizer=family_tokenizer(_QWEN2_AUDIO_TOKENS))


def _qwen2_audio_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(
        text_config=qwen2_text(len(processor.tokenizer), initializer_range, layers),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "initializer_range": initializer_range},
        audio_token_index=processor.audio_token_id,
    )
    return Qwen2AudioForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "qwen2_audio": Builder(
        _qwen2_audio_processor,
        _qwen2_audio_model,
        "Qwen tokenizer + Qwen2-Audio's audio tokens instead of the checkpoint's; the official template "
        "(Qwen2AudioProcessor.default_chat_template); real WhisperFeatureExtractor (16 mel bins) and "
        "Qwen2AudioProcessor; Qwen2 text",
        own_proof=True,  # audio only: proven on audio batches of its own (tests/test_family_qwen2_audio.py)
    ),
}
