"""Tiny random models and offline processors for the round-3a families (Llama 4, Mllama, ...).

Built like ``vlm_pack.testing.tiny_families``, whose ``tiny_vlm_processor`` / ``tiny_vlm`` build these too: the small
Qwen tokenizer plus the family's special tokens, the family's own image-processor and processor classes built from
parameters (tiny tiles), and the chat template the processor class ships (Llama 4's official template is in
``transformers.models.llama4.processing_llama4``) or, where no official template is installed, ChatML with the
family's image placeholder. Models are built from config objects (hidden 64, 1-2 layers, ``initializer_range`` 0.2
so a wrong mask or position visibly changes the loss).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, ProcessorMixin

from .tiny_families import _HIDDEN, _LLAVA_PINPOINTS, _Builder, _llava_sizes, _tokenizer, chatml_template

__all__ = ["ROUND3A_BUILDERS", "llama4_text_config", "tiny_gemma3n_text"]


# ---------------------------------------------------------------- Llama 4

# 28-px tiles of 7-px patches, pixel shuffle 0.5: 4 <|patch|> tokens per tile; up to 4 tiles + the global view.
# Chunks of 8 tokens make the chunked layers bite inside every sample.
_LLAMA4_TOKENS = ["<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                  "<|tile_y_separator|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>",
                  "<|python_end|>"]
LLAMA4_CHUNK = 8


def _llama4_processor() -> ProcessorMixin:
    from transformers import Llama4ImageProcessor, Llama4Processor
    from transformers.models.llama4 import processing_llama4

    class Fp32Llama4ImageProcessor(Llama4ImageProcessor):
        """The real image processor, its bf16 pixel values (as the checkpoint's) handed on as fp32 for the fp32
        tiny model (the stock model does not cast them)."""

        def rescale_and_normalize(self, *args, **kwargs):
            return super().rescale_and_normalize(*args, **kwargs).float()

    tokenizer = _tokenizer(_LLAMA4_TOKENS)
    tokenizer.chat_template = None
    return Llama4Processor(
        image_processor=Fp32Llama4ImageProcessor(size={"height": 28, "width": 28}, max_patches=4),
        tokenizer=tokenizer, patch_size=7, pixel_shuffle_ratio=0.5, chat_template=processing_llama4.chat_template,
    )


def llama4_text_config(vocab_size: int, initializer_range: float = 0.2, layers: int = 2, **overrides) -> dict:
    """Tiny Llama 4 text: 2 layers (layer 0 chunked with RoPE, layer 1 full attention, NoPE, MoE of 2 experts)."""
    return {
        "vocab_size": vocab_size, "hidden_size": _HIDDEN, "intermediate_size": 2 * _HIDDEN,
        "intermediate_size_mlp": 2 * _HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": _HIDDEN // 4, "num_local_experts": 2, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "attention_chunk_size": LLAMA4_CHUNK, "no_rope_layer_interval": 2,
        "initializer_range": initializer_range, "attention_dropout": 0.0, "bos_token_id": None,
        "eos_token_id": None, **overrides,
    }


def _llama4_model(processor, initializer_range: float, layers: int, attn: str, **text) -> PreTrainedModel:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Llama4Config(
        vision_config={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 7, "vision_output_dim": 32, "projector_input_dim": 32,
                       "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5, "initializer_range": initializer_range},
        text_config=llama4_text_config(len(tokenizer), initializer_range, layers,
                                       pad_token_id=tokenizer.pad_token_id, **text),
        image_token_index=tokenizer.convert_tokens_to_ids("<|patch|>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<|image_start|>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<|image_end|>"),
    )
    model = Llama4ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.language_model.register_forward_hook(_no_image_outputs)
    return model


def _no_image_outputs(module, args, output):
    """transformers 5.24's ``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` from its language
    model's output, which has none, and fails on every call (``return_dict=False`` included; 5.25 does not read it);
    this hook adds the missing attribute (None) so the STOCK reference completes (``enable_packing`` adds the same
    field itself: vlm_pack.models.llama4). Nothing computed changes."""
    if not hasattr(output, "image_outputs"):
        output.image_outputs = None
    return output


# ---------------------------------------------------------------- Granite 4 Vision (LLaVA-NeXT crops, window Q-Former)

# 28-px crops of 7-px patches (CLIP, CLS dropped: 16 patches), anyres pinpoints up to 2x2 crops; the Q-Former
# downsamples each crop 1/2 (4 tokens per crop). Deepstack: the last vision layer into text layer 0, the first into
# text layer 1; spatial groups into both layers.


def _granite4_vision_processor() -> ProcessorMixin:
    from transformers import LlavaNextImageProcessor
    from transformers.models.granite4_vision.processing_granite4_vision import Granite4VisionProcessor

    return Granite4VisionProcessor(
        image_processor=LlavaNextImageProcessor(**_llava_sizes(), image_grid_pinpoints=_LLAVA_PINPOINTS),
        tokenizer=_tokenizer(["<image>"]), patch_size=7, vision_feature_select_strategy="default",
        chat_template=chatml_template("<image>"), downsample_rate="1/2", num_additional_image_tokens=1,
    )


def _granite4_vision_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import Granite4VisionConfig, Granite4VisionForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Granite4VisionConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": _HIDDEN, "intermediate_size": _HIDDEN,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 7},
        text_config={"vocab_size": len(tokenizer), "hidden_size": _HIDDEN, "intermediate_size": 2 * _HIDDEN,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "initializer_range": initializer_range, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                     "attention_multiplier": 0.3, "logits_scaling": 2.0},
        qformer_config={"num_hidden_layers": 1, "intermediate_size": _HIDDEN},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=_LLAVA_PINPOINTS, downsample_rate="1/2",
        deepstack_layer_map=[[-1, 0], [0, layers - 1]], spatial_target_layers=[0, layers - 1, layers - 1, 0],
        projector_dropout=0.0, initializer_range=initializer_range,
    )
    return Granite4VisionForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Granite Docling (Idefics3-style page tiles)

# 28-px tiles of 7-px patches, pixel shuffle 2: 4 <image> tokens per tile, up to 4 tiles + the global view. One
# deepstack merger (vision layer 0); the coarse route only (as the 2B checkpoint).
_DOCLING_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 5) for col in range(1, 5)
]


def _granite_docling_processor() -> ProcessorMixin:
    from transformers.models.granite_docling.image_processing_granite_docling import GraniteDoclingImageProcessor
    from transformers.models.granite_docling.processing_granite_docling import GraniteDoclingProcessor

    return GraniteDoclingProcessor(
        image_processor=GraniteDoclingImageProcessor(size={"height": 28, "width": 28}, max_patches=4),
        tokenizer=_tokenizer(_DOCLING_TOKENS), image_seq_len=4, chat_template=chatml_template("<image>"),
    )


def _granite_docling_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import GraniteDoclingConfig, GraniteDoclingForConditionalGeneration

    tokenizer = processor.tokenizer
    config = GraniteDoclingConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 7, "out_hidden_size": _HIDDEN, "scale_factor": 2,
                       "deepstack_visual_indexes": [0], "use_fine_route": False,
                       "initializer_range": initializer_range},
        text_config={"vocab_size": len(tokenizer), "hidden_size": _HIDDEN, "intermediate_size": 2 * _HIDDEN,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "initializer_range": initializer_range, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                     "attention_multiplier": 0.3, "logits_scaling": 2.0, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": None, "eos_token_id": None},
        image_token_id=processor.image_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return GraniteDoclingForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------- Mllama (Llama 3.2 Vision)

# 28-px tiles of 7-px patches (16 patches + CLS per tile), up to 4 tiles per image; text layers: 0 self-attention,
# 1 cross-attention (2 layers), or 0 self, 1 cross, 2 self (3 layers). The gates that a fresh model zeroes (cross-
# attention and tile-embedding gates: the layers would be no-ops) get random values, so every path counts.


def _mllama_processor() -> ProcessorMixin:
    from transformers import MllamaImageProcessor, MllamaProcessor

    tokenizer = _tokenizer(["<|image|>", "<|begin_of_text|>"])
    tokenizer.bos_token = "<|begin_of_text|>"
    return MllamaProcessor(
        image_processor=MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=4),
        tokenizer=tokenizer, chat_template="{{- bos_token -}}" + chatml_template("<|image|>"),
    )


def _mllama_model(processor, initializer_range: float, layers: int, attn: str) -> PreTrainedModel:
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = MllamaConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                       "attention_heads": 2, "image_size": 28, "patch_size": 7, "max_num_tiles": 4,
                       "intermediate_layers_indices": [0], "vision_output_dim": 64,
                       "initializer_range": initializer_range},
        text_config={"vocab_size": len(tokenizer), "hidden_size": _HIDDEN, "intermediate_size": 2 * _HIDDEN,
                     "num_hidden_layers": layers + 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "cross_attention_layers": [1], "initializer_range": initializer_range,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": None,
                     "pad_token_id": tokenizer.pad_token_id},
        image_token_index=processor.image_token_id,
    )
    model = MllamaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "gate" in name.rsplit(".", 1)[-1] and not parameter.any():
                parameter.uniform_(-1.0, 1.0)
    return model


# ---------------------------------------------------------------- Gemma 3n text (Gemma3nForCausalLM)


def tiny_gemma3n_text(seed: int = 0, attn_implementation: str = "sdpa", initializer_range: float = 0.2,
                      vocab_size: int = 4200) -> PreTrainedModel:
    """A tiny random fp32 ``Gemma3nForCausalLM`` in eval mode: 4 layers (sliding window 4, full, sliding, full), the
    last 2 sharing KV with earlier ones, per-layer inputs, AltUp (2 inputs), LAuReL and 95% activation sparsity on
    layer 0 (the Gaussian top-k path)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, hidden_size=_HIDDEN,
        intermediate_size=2 * _HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=_HIDDEN // 4, sliding_window=4, hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], initializer_range=initializer_range,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3nForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


# ---------------------------------------------------------------- Phi-4-multimodal

# The image processor counts tokens for 448-px crops of 14-px patches only (256 + 16 per crop, hard-coded), so the
# tiny tower keeps that geometry (hidden 32, 1 layer); dynamic_hd=2: a global view plus up to 2 crops.


def _phi4_multimodal_processor() -> ProcessorMixin:
    from transformers import (AutoTokenizer, Phi4MultimodalFeatureExtractor, Phi4MultimodalImageProcessor,
                              Phi4MultimodalProcessor)

    from .tiny_models import small_qwen_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(
        small_qwen_tokenizer_path(), extra_special_tokens={"image_token": "<|image|>", "audio_token": "<|audio|>"})
    return Phi4MultimodalProcessor(Phi4MultimodalImageProcessor(dynamic_hd=2), Phi4MultimodalFeatureExtractor(),
                                   tokenizer, chat_template=chatml_template("<|image|>"))


def _phi4_multimodal_model(processor, initializer_range: float, layers: int, attn: str,
                           original_max_position_embeddings: int = 4096) -> PreTrainedModel:
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    tokenizer = processor.tokenizer
    half = _HIDDEN // 4 // 2  # longrope factors: one per rotary frequency
    config = Phi4MultimodalConfig(
        vocab_size=len(tokenizer), hidden_size=_HIDDEN, intermediate_size=2 * _HIDDEN, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None,
        max_position_embeddings=4 * original_max_position_embeddings,
        original_max_position_embeddings=original_max_position_embeddings,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 8 for i in range(half)],
                         "long_factor": [2.0 + i for i in range(half)],
                         "original_max_position_embeddings": original_max_position_embeddings},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 448, "patch_size": 14, "crop_size": 448, "feature_layer": -1,
                       "image_token_id": processor.image_token_id},
        audio_config={"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1, "num_attention_heads": 2,
                      "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32,
                      "audio_token_id": processor.audio_token_id},
    )
    return Phi4MultimodalForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUND3A_BUILDERS = {
    "llama4": _Builder(
        _llama4_processor, _llama4_model,
        "Qwen tokenizer + Llama 4's header and image tokens; the official Llama 4 chat template as transformers ships "
        "it (processing_llama4.chat_template); real Llama4ImageProcessor (28-px tiles, up to 4 + global view, its "
        "bf16 values cast to fp32) and Llama4Processor",
    ),
    "granite4_vision": _Builder(
        _granite4_vision_processor, _granite4_vision_model,
        "Qwen tokenizer + '<image>' and ChatML (no official Granite template is installed); real "
        "LlavaNextImageProcessor (anyres 28-px crops, up to 2x2) and Granite4VisionProcessor; CLIP tower",
    ),
    "granite_docling": _Builder(
        _granite_docling_processor, _granite_docling_model,
        "Qwen tokenizer + Idefics3-style tile tokens and ChatML (no official Granite Docling template is installed); "
        "real GraniteDoclingImageProcessor (28-px tiles, up to 4 + global view) and GraniteDoclingProcessor",
    ),
    "mllama": _Builder(
        _mllama_processor, _mllama_model,
        "Qwen tokenizer + '<|image|>' / '<|begin_of_text|>' and ChatML after the BOS (no official Llama 3.2 Vision "
        "template is installed; TRL's llama3_2 is text-only); real MllamaImageProcessor (28-px tiles, up to 4) "
        "and MllamaProcessor; the gates a fresh model zeroes set at random",
    ),
    "phi4_multimodal": _Builder(
        _phi4_multimodal_processor, _phi4_multimodal_model,
        "Qwen tokenizer + '<|image|>' / '<|audio|>' and ChatML (no official Phi-4-multimodal template is installed; "
        "TRL's phi3 ones are text-only); real Phi4MultimodalImageProcessor (448-px dynamic-HD crops, up to 2) and "
        "Phi4MultimodalProcessor; longrope with distinct short / long factors",
    ),
}
