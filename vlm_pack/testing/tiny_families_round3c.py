"""Tiny random models and offline processors for the round-3c families (composite Gemma 3n, PaliGemma, ...).

Built like ``vlm_pack.testing.tiny_families``, whose ``tiny_vlm_processor`` / ``tiny_vlm`` build these too: the small
Qwen tokenizer plus the family's special tokens, the family's own image-processor / processor classes built from
parameters (tiny images), and the official chat template where one is installed (TRL ships Gemma 3's, which
Gemma 3n uses). Models are built from config objects (hidden 64, ``initializer_range`` 0.2 so a wrong mask or
position visibly changes the loss); timm towers (Gemma 3n's MobileNetV5, ...) get a few-block architecture through
``vision_config.model_args``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _HIDDEN, _Builder, _qwen2_text, _tokenizer, chatml_template

__all__ = ["ROUND3C_BUILDERS"]


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


# ---------------------------------------------------------------- PaliGemma (SigLIP + Gemma, prefix-LM)

# 28-px images of 14-px patches: 4 <image> tokens per image; a 2-layer Gemma (no chat template: the processor's own
# prompt / suffix rule, vlm_pack.models.paligemma.encode_sample).
_PALIGEMMA_IMAGE = 28


def _paligemma_processor() -> ProcessorMixin:
    from transformers import PaliGemmaProcessor, SiglipImageProcessor

    from .tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    image_processor = SiglipImageProcessor(size={"height": _PALIGEMMA_IMAGE, "width": _PALIGEMMA_IMAGE})
    image_processor.image_seq_length = (_PALIGEMMA_IMAGE // 14) ** 2
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)


# PaliGemma 2's Gemma 2: attention-logit and final softcapping small enough to bite on tiny scores, sliding layers
# (40 tokens: every prefix of the tests fits, the longest answers run past it), query_pre_attn_scalar != head_dim.
_GEMMA2_TEXT = {"model_type": "gemma2", "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                "sliding_window": 40, "query_pre_attn_scalar": 8}


def _paligemma_model(processor, initializer_range: float, layers: int, attn: str,
                     gemma2: bool = False) -> PreTrainedModel:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = PaliGemmaConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": _PALIGEMMA_IMAGE, "patch_size": 14, "projection_dim": _HIDDEN},
        text_config={"model_type": "gemma", "vocab_size": len(tokenizer), "hidden_size": _HIDDEN,
                     "intermediate_size": 2 * _HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": _HIDDEN // 4, "initializer_range": initializer_range,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": None, **(_GEMMA2_TEXT if gemma2 else {})},
        image_token_id=processor.image_token_id, projection_dim=_HIDDEN, pad_token_id=tokenizer.pad_token_id,
    )
    return PaliGemmaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- FastVLM (timm FastViT-MCi + Qwen2)

# 128-px images (CLIP resize + centre crop), a 5-stage FastViT-MCi of one block per stage (total stride 64): a 2x2
# feature map, 4 <image> tokens per image; BatchNorm layers in the convolutional blocks (eval mode here).
_FAST_VLM_IMAGE = 128


def _fast_vlm_processor() -> ProcessorMixin:
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(size={"shortest_edge": _FAST_VLM_IMAGE},
                                         crop_size={"height": _FAST_VLM_IMAGE, "width": _FAST_VLM_IMAGE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=_tokenizer(["<image>"]), patch_size=64,
                          vision_feature_select_strategy="full", num_additional_image_tokens=0,
                          chat_template=chatml_template("<image>"))


def _fast_vlm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration

    config = FastVlmConfig(
        vision_config={"model_type": "timm_wrapper", "architecture": "fastvit_mci3", "do_pooling": False,
                       "hidden_size": _HIDDEN, "model_args": {"inference_mode": True, "layers": [1] * 5,
                                                              "embed_dims": [8, 16, 16, 32, 32]}},
        text_config=_qwen2_text(len(processor.tokenizer), initializer_range, layers),
        image_token_index=processor.image_token_id, image_seq_length=(_FAST_VLM_IMAGE // 64) ** 2,
    )
    model = FastVlmForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # timm's init (layer scales 1e-5) makes the tiny tower's output ~1e-23 for every image
        for parameter in model.model.vision_tower.parameters():
            parameter.normal_(0.0, 0.3)
        for module in model.model.vision_tower.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.normal_(0.0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model


# ---------------------------------------------------------------- PerceptionLM (timm Perception Encoder + Llama)

# 32-px tiles of 16-px patches (4 tokens per tile, no pooling), a thumbnail plus up to 4 tiles per image; a one-block
# Perception Encoder (rope attention, class token dropped by the model).
_PLM_TILE = 32


def _perception_lm_processor() -> ProcessorMixin:
    from transformers import (AutoTokenizer, PerceptionLMImageProcessor, PerceptionLMProcessor,
                              PerceptionLMVideoProcessor)

    from .tiny_models import small_qwen_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(
        small_qwen_tokenizer_path(), extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    return PerceptionLMProcessor(
        video_processor=PerceptionLMVideoProcessor(), tokenizer=tokenizer, patch_size=16, pooling_ratio=1,
        image_processor=PerceptionLMImageProcessor(tile_size=_PLM_TILE, max_num_tiles=4),
        chat_template=chatml_template("<|image|>"),
    )


def _perception_lm_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import PerceptionLMConfig, PerceptionLMForConditionalGeneration

    config = PerceptionLMConfig(
        vision_config={"model_type": "timm_wrapper", "architecture": "vit_pe_core_tiny_patch16_384",
                       "model_args": {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": _PLM_TILE,
                                      "ref_feat_shape": [2, 2], "global_pool": ""}},
        text_config={"model_type": "llama", "vocab_size": len(processor.tokenizer), "hidden_size": _HIDDEN,
                     "intermediate_size": 2 * _HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id, projector_pooling_ratio=1,
    )
    return PerceptionLMForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND3C_BUILDERS = {
    "gemma3n": _Builder(
        _gemma3n_processor, _gemma3n_model,
        "Qwen tokenizer + Gemma 3n's image / audio / turn tokens in the checkpoint's id layout; Gemma 3's official "
        "chat template as TRL ships it, images written as '<image_soft_token>' as Gemma 3n's template does; real "
        "SiglipImageProcessor (48 px) and Gemma3nProcessor; a 3-stage timm MobileNetV5 (4 soft tokens per image); "
        "4 text layers as gemma3n_text's",
    ),
    "paligemma": _Builder(
        _paligemma_processor, _paligemma_model,
        "Qwen tokenizer + '<bos>' and PaliGemma's '<image>' (added by the processor); no chat template: the "
        "processor's own prompt / suffix encoding; real SiglipImageProcessor (28 px: 4 image tokens) and "
        "PaliGemmaProcessor; a 2-layer Gemma",
    ),
    "paligemma2": _Builder(
        _paligemma_processor, lambda *args: _paligemma_model(*args, gemma2=True),
        "as paligemma, with a 2-layer Gemma 2 (one sliding layer of 40 tokens, one global; attention-logit softcap 2, "
        "final logit softcap 5, query_pre_attn_scalar 8): PaliGemma 2's language model",
    ),
    "fast_vlm": _Builder(
        _fast_vlm_processor, _fast_vlm_model,
        "Qwen tokenizer + '<image>' and ChatML (no official FastVLM template is installed); real CLIPImageProcessor "
        "(128 px) and LlavaProcessor (as the FastVLM checkpoints); a one-block-per-stage timm FastViT-MCi",
    ),
    "perception_lm": _Builder(
        _perception_lm_processor, _perception_lm_model,
        "Qwen tokenizer + '<|image|>' / '<|video|>' and ChatML (no official PerceptionLM template is installed); real "
        "PerceptionLMImageProcessor (32-px tiles: thumbnail + up to 4) and PerceptionLMProcessor; a one-block timm "
        "Perception Encoder",
    ),
}
