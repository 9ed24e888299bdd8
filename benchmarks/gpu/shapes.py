"""The models the GPU stages train, at real shapes with random weights (tiny ones in the dry run), the chat
examples they are fed (lengths from the real ShareGPT histogram, photos at their own size) and their FLOPs.

* ``qwen2_vl``: Qwen2-VL-2B's shape: 28 layers, hidden 1536, 12 / 2 heads, MLP 8960, 151936-token vocabulary,
  vision tower of 32 blocks, width 1280, 14-px patches merged 2x2 (~2.2B parameters);
* ``text``: Qwen2-1.5B's shape, the same language model without vision (~1.5B parameters).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from benchmarks.gpu.common import linear_weights
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, qwen_tokenizer, tiny_config, tiny_model

TEXT = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
            num_key_value_heads=2, head_dim=128, tie_word_embeddings=True, attention_dropout=0.0,
            initializer_range=0.02)
VISION = dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.02)
# Qwen2-VL-2B-Instruct's processor bounds (so a photo keeps its own size)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384
WORDS = ("the of and to in is was for on that with as by at from this be are it or an which have has not but "
         "model data image token training packing sequence batch length memory question answer colour shape left "
         "right above below small large red blue green photo cat rocket coffee cup space light time place").split()


def build(kind: str, dry: bool, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random model of ``kind`` built directly on ``device`` in ``dtype``, attention ``sdpa`` (train mode)."""
    if dry:
        model = tiny_model("qwen2_vl") if kind == "qwen2_vl" else tiny_model("qwen2", vocab_size=len(qwen_tokenizer()))
        return model.to(device=device, dtype=dtype).train()
    if kind == "qwen2_vl":
        ids = tiny_config("qwen2_vl", full_vocabulary=True)
        text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}}
        config = Qwen2VLConfig(text_config=text, vision_config=VISION, image_token_id=ids.image_token_id,
                               video_token_id=ids.video_token_id, vision_start_token_id=ids.vision_start_token_id,
                               vision_end_token_id=ids.vision_end_token_id, tie_word_embeddings=True)
        cls = Qwen2VLForConditionalGeneration
    else:
        config = Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen2ForCausalLM
    with torch.device(device):
        return cls._from_config(config, attn_implementation="sdpa", dtype=dtype).train()


def processor(kind: str, dry: bool):
    """The Qwen2-VL processor (real tokenizer and pixel bounds on the GPU) or the plain tokenizer."""
    if kind == "qwen2_vl":
        return offline_qwen2vl_processor() if dry else offline_qwen2vl_processor(
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, full_vocabulary=True)
    return qwen_tokenizer(full_vocabulary=not dry)


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=max(1, words)))


def chat_examples(rng: np.random.Generator, lengths: list[int], photos: list | None = None) -> list[dict]:
    """One user / assistant exchange per length (about that many tokens: a third question, the rest answer);
    with ``photos``, every other sample asks about one photo at its own size (its tokens counted in the length)."""
    examples = []
    for i, n in enumerate(lengths):
        content: list[dict] = [{"type": "text", "text": _text(rng, n // 3)}]
        if photos and i % 2 == 0:
            content.insert(0, {"type": "image", "image": photos[int(rng.integers(len(photos)))]})
        examples.append({"messages": [{"role": "user", "content": content},
                                      {"role": "assistant", "content": [{"type": "text",
                                                                         "text": _text(rng, n - n // 3)}]}]})
    return examples


def step_flops(model: torch.nn.Module, lengths: list[int], image_patches: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) on the REAL tokens: 2 x the linear
    layers' multiply-adds per token (LM head included), 4 x heads x head_dim per causal query-key pair per layer,
    and the vision tower per image (full attention over its patches)."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    forward = 2 * linear_weights(model, vision=False) * sum(lengths)
    forward += 4 * text.num_hidden_layers * text.num_attention_heads * head_dim * pairs
    vision = getattr(model.config, "vision_config", None)
    if vision is not None and image_patches:
        forward += 2 * linear_weights(model, vision=True) * sum(image_patches)
        forward += 4 * vision.depth * vision.embed_dim * sum(p * p for p in image_patches)
    return 3 * forward
