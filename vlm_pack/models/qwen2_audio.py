"""Qwen2-Audio (Whisper-style audio tower + Qwen2 text): audio features placed by audio-token id, 1-D positions per
sample.

Rules (proven in tests/test_family_qwen2_audio.py against each sample alone through the stock sdpa model): the audio
tower runs each clip as its own row (``input_features`` / ``feature_attention_mask``: one row per clip, 30-s Whisper
frames, the tower's bidirectional mask from the clip's own frame count), its features trimmed to each clip's token
count fill the ``<|AUDIO|>`` tokens in sample order (``masked_scatter``). Samples with audio are encoded alone (a
clip's features must not depend on the call). The language model is a proven text family (Qwen2).
"""

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

_PROOF = "tests/test_family_qwen2_audio.py"

QWEN2_AUDIO = register_family(FamilySpec(
    name="qwen2_audio", model_types=("qwen2_audio",),
    proof=Proof(
        _PROOF,
        min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
        proven={
            "audio": f"{_PROOF}::test_audio_edge_batch_equals_each_sample_alone[qwen2_audio]",
            "context_parallel": f"{_PROOF}::test_audio_edge_batch_equals_each_sample_alone[qwen2_audio]",
        },
        refused={"budget": "Qwen2AudioProcessor has no _get_num_multimodal_tokens (transformers 5.24 / 5.25), so a "
                           "clip's token count cannot be planned from its length by the processor's own rule; pack by "
                           "micro-batch (VLMPackingCollator)"},
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2"),)),
    encoding=EncodingRules(
        media_tokens=("<|audio_bos|>", "<|audio_eos|>"),
        vision=VisionRows(rows={"input_features": "audio", "feature_attention_mask": "audio"}),
    ),
))
