"""Tiny random models and offline processors for the round-3c families (composite Gemma 3n, PaliGemma, ...).

Assembled like ``vlm_pack.testing.tiny_families_round3a``: the small Qwen tokenizer plus the family's special
tokens, the family's own image-processor / processor classes built from parameters (tiny images), and the official
chat template where one is installed (TRL ships Gemma 3's, which Gemma 3n uses). Models are built from config
objects (hidden 64, ``initializer_range`` 0.2 so a wrong mask or position visibly changes the loss); timm towers
(Gemma 3n's MobileNetV5, ...) get a few-block architecture through ``vision_config.model_args``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, ProcessorMixin

__all__ = ["ROUND3C_FAMILIES", "round3c_processor", "round3c_vlm"]

_HIDDEN = 64


# ---------------------------------------------------------------- Gemma 3n (composite: timm MobileNetV5 + Gemma 3n text)

# 48-px images; a 3-stage MobileNetV5 (er, uir, uir + mqa + uir blocks: a stage must end on a uir) whose multi-scale fusion adapter pools to 2x2:
# 4 soft tokens per image. Token ids follow the checkpoint's layout: text ids, then the vision vocabulary
# (<end_of_image>, <image_soft_token>), then the audio vocabulary (<end_of_audio>, <audio_soft_token>).
_GEMMA3N_IMAGE = 48
_GEMMA3N_SOFT = 2
_GEMMA3N_TOKENS = {"boi_token": "<start_of_image>", "boa_token": "<start_of_audio>", "sot_token": "<start_of_turn>",
                   "eot_token": "<end_of_turn>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                   "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
_GEMMA3N_BLOCKS = [["er_r1_k3_s2_e4_c16"], ["uir_r1_a3_k5_s2_e2_c16"],
                   ["uir_r1_a3_k5_s2_e2_c32", "mqa_r1_k3_h2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"]]


def _gemma3n_processor() -> ProcessorMixin:
    from transformers import AutoTokenizer, Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessor

    from .tiny_models import official_template, small_qwen_tokenizer_path

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
            "vocab_size": len(tokenizer), "vocab_size_per_layer_input": vision_offset, "hidden_size": _HIDDEN,
            "intermediate_size": 2 * _HIDDEN, "num_hidden_layers": 2 * layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": _HIDDEN // 4, "sliding_window": 4, "hidden_size_per_layer_input": 8,
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


@dataclass(frozen=True)
class _Builder:
    processor: Callable[[], ProcessorMixin]
    model: Callable[..., PreTrainedModel]
    substituted: str


_BUILDERS = {
    "gemma3n": _Builder(
        _gemma3n_processor, _gemma3n_model,
        "Qwen tokenizer + Gemma 3n's image / audio / turn tokens in the checkpoint's id layout; Gemma 3's official "
        "chat template as TRL ships it, images written as '<image_soft_token>' as Gemma 3n's template does; real SiglipImageProcessor (48 px) and "
        "Gemma3nProcessor; a 3-stage timm MobileNetV5 (4 soft tokens per image); 4 text layers as gemma3n_text's",
    ),
}
ROUND3C_FAMILIES = tuple(_BUILDERS)


def round3c_processor(family: str) -> ProcessorMixin:
    """The offline processor for ``family`` (module docstring: what is substituted)."""
    return _builder(family).processor()


def round3c_vlm(family: str, processor: ProcessorMixin, *, attn_implementation: str = "sdpa", seed: int = 0,
                initializer_range: float = 0.2, layers: int = 2) -> PreTrainedModel:
    """A tiny random fp32 ``family`` model in eval mode matching ``processor``; the same ``seed`` gives the same
    weights for every ``attn_implementation``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _builder(family).model(processor, initializer_range, layers, attn_implementation)
    return model.eval()


def _builder(family: str) -> _Builder:
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny round-3c family {family!r}; choose one of {ROUND3C_FAMILIES}")
    return _BUILDERS[family]
