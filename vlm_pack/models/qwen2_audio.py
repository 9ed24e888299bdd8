"""Qwen2-Audio (Whisper-style audio tower + Qwen2 text): audio features placed by audio-token id, 1-D positions per
sample.

Rules (proven in tests/test_families_round4.py against each sample alone through the stock sdpa model): the audio
tower runs each clip as its own row (``input_features`` / ``feature_attention_mask``: one row per clip, 30-s Whisper
frames, the tower's bidirectional mask from the clip's own frame count), its features trimmed to each clip's token
count fill the ``<|AUDIO|>`` tokens in sample order (``masked_scatter``). Samples with audio are encoded alone (a
clip's features must not depend on the call). The language model is a proven text family (Qwen2).
"""

from . import FamilySpec, register_family, text_backbone

QWEN2_AUDIO = register_family(FamilySpec(
    name="qwen2_audio", model_types=("qwen2_audio",), proof="tests/test_families_round4.py",
    min_transformers="5.24",  # proven on 5.24 and 5.25 only (registered in round 4)
    proven={
        "audio": "tests/test_families_round4.py::test_audio_edge_batch_equals_each_sample_alone[qwen2_audio]",
        "context_parallel": "tests/test_families_round4.py::test_audio_edge_batch_equals_each_sample_alone[qwen2_audio]",
    },
    refused={"budget": "Qwen2AudioProcessor has no _get_num_multimodal_tokens (transformers 5.24 / 5.25), so a clip's "
                       "token count cannot be planned from its length by the processor's own rule; pack by "
                       "micro-batch (VLMPackingCollator)"},
    vision_rows={"input_features": "audio", "feature_attention_mask": "audio"},
    media_tokens=("<|audio_bos|>", "<|audio_eos|>"),
    extra_checks=(text_backbone("qwen2"),),
))
