"""Tiny Gemma 3n: its text model alone and the composite (timm MobileNetV5 + Gemma 3n text):
offline processors and random models (registered in ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from ..family_parts import HIDDEN, Builder

__all__ = ["BUILDERS", "tiny_gemma3n_text"]

# ---------------------------------------------------------------- Gemma 3n text (Gemma3nForCausalLM)


def tiny_gemma3n_text(seed: int = 0, attn_implementation: str = "sdpa", initializer_range: float = 0.2,
                      vocab_size: int = 4200) -> PreTrainedModel:
    """A tiny random fp32 ``Gemma3nForCausalLM`` in eval mode: 4 layers (sliding window 4, full, sliding, full), the
    last 2 sharing KV with earlier ones, per-layer inputs, AltUp (2 inputs), LAuReL and 95% activation sparsity on
    layer 0 (the Gaussian top-k path)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=HIDDEN // 4, sliding_window=4, hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], initializer_range=initializer_range,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3nForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


# ---------------------------------------------------------------- Gemma 3n (timm MobileNetV5 + Gemma 3n text)

# 48-px images; a 3-stage MobileNetV5 (er, uir, uir + mqa + uir blocks: a stage must end on a uir) whose
# multi-scale fusion adapter pools to 2x2: 4 soft tokens per image. Token ids follow the checkpoint's layout: text
# ids, then the vision vocabulary (<end_of_image>, <image_soft_token>), then the audio vocabulary (<end_of_audio>,
# <audio_soft_token>).
_GEMMA3N_IMAGE = 48
_GEMMA3N_SOFT = 2
_GEMMA3N_TOKENS = {"boi_token": "<start_of_image>", "boa_token": "<start_of_audio>", "sot_token": "<start_of_turn>",
                   "eot_token": "<end_of_turn>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                   "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
_GEMMA3N_BLOCKS = [["er_r1_k3_s2_e4_c16"], ["uir_r1_a3_k5_s2_e2_c16"],
                   ["uir_r1_a3_k5_s2_e2_c32", "mqa_r1_k3_h2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"]]


def _gemma3n_processor() -> ProcessorMixin:
    from transformers import AutoTokenizer, Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessor

    from ..tiny_models import official_template, small_qwen_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(small_qwen_tokenizer_path(), extra_special_tokens=_GEMMA3N_TOKENS)
    # Gemma 3n's template is Gemma 3's with each image written as <image_soft_token> (the token Gemma3nProcessor
    # expands) instead of <start_of_image>
    template = official_template("gemma3").replace("{{ '<start_of_image>' }}", "{{ '<image_soft_token>' }}")
    tokenizer.chat_template = template
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(),
        image_processor=SiglipImageProcessor(size={"height": _GEMMA3N_IMAGE, "width": _GEMMA3N_IMAGE}),
        tokenizer=tokenizer, chat_template=template, image_seq_length=_GEMMA3N_SOFT ** 2, audio_seq_length=4,
    )


def _gemma3n_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from timm.models._efficientnet_builder import decode_arch_def
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    tokenizer = processor.tokenizer
    vision_offset = tokenizer.convert_tokens_to_ids("<end_of_image>")
    audio_offset = tokenizer.convert_tokens_to_ids("<end_of_audio>")
    assert audio_offset == vision_offset + 2 == len(tokenizer) - 2, "token layout of the tiny Gemma 3n"
    kinds = ["sliding_attention", "full_attention"] * 2
    config = Gemma3nConfig(
        text_config={
            "vocab_size": len(tokenizer), "vocab_size_per_layer_input": vision_offset, "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2 * layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "sliding_window": 4, "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": layers, "laurel_rank": 4, "layer_types": kinds[:2 * layers], "altup_num_inputs": 2,
            "activation_sparsity_pattern": [0.95] + [0.0] * (2 * layers - 1), "initializer_range": initializer_range,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"architecture": "mobilenetv5_300m_enc", "hidden_size": 2048, "vocab_size": 2,
                       "vocab_offset": vision_offset, "initializer_range": initializer_range,
                       "model_args": {"block_args": decode_arch_def(_GEMMA3N_BLOCKS),
                                      "msfa_output_resolution": _GEMMA3N_SOFT}},
        audio_config={"vocab_size": 2, "vocab_offset": audio_offset, "hidden_size": 32, "conf_num_attention_heads": 2,
                      "conf_num_hidden_layers": 1, "sscp_conv_channel_size": [8, 8], "conf_attention_chunk_size": 4,
                      "conf_attention_context_left": 5, "conf_attention_context_right": 0},
        vision_soft_tokens_per_image=_GEMMA3N_SOFT ** 2, audio_soft_tokens_per_image=4,
        boi_token_id=tokenizer.convert_tokens_to_ids("<start_of_image>"), eoi_token_id=vision_offset,
        image_token_id=processor.image_token_id, boa_token_id=tokenizer.convert_tokens_to_ids("<start_of_audio>"),
        eoa_token_id=audio_offset, audio_token_id=processor.audio_token_id, initializer_range=initializer_range,
    )
    return Gemma3nForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


BUILDERS = {
    "gemma3n": Builder(
        _gemma3n_processor, _gemma3n_model,
        "Qwen tokenizer + Gemma 3n's image / audio / turn tokens in the checkpoint's id layout; Gemma 3's official "
        "chat template as TRL ships it, images written as '<image_soft_token>' as Gemma 3n's template does; real "
        "SiglipImageProcessor (48 px) and Gemma3nProcessor; a 3-stage timm MobileNetV5 (4 soft tokens per image); "
        "4 text layers as gemma3n_text's",
        own_proof=True,
    ),
}
