"""Shared pieces of the RL tests: TRL's GRPO / RLOO trainers with generation replaced by FIXED completions.

``fixed(trainer_cls)`` subclasses a trainer (TRL's own or ours) so that ``_generate_single_turn`` returns the same
token ids for the same rollout slot and prompt: prompt tokenisation, rewards, advantages, the old / reference
forwards and the loss all run as the trainer ships them.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import shutil
import tempfile

import datasets
import torch
from transformers import MistralForCausalLM

from preference_helpers import _WORDS, GradientsAtStep, word_tokenizer
from vlm_pack.testing.data import _fit, sample_photos
from vlm_pack.testing.tiny_families import mistral_text_config, tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import _MODEL_CLASSES, offline_qwen2vl_processor, tiny_model

G = 4  # rollouts per prompt
MAX_COMPLETION = 12
SIDES = (56, 84, 112, 70)


def completion_ids(row: int, prompt: list[int], eos: int, low: int, high: int) -> list[int]:
    """Fixed completion of generation-batch row ``row``: 2..MAX_COMPLETION ids, every third row truncated (no EOS)."""
    size = 2 + (5 * row + len(prompt)) % (MAX_COMPLETION - 1)
    ids = [low + (len(prompt) * 13 + row * 7 + j * 3) % (high - low) for j in range(size)]
    if row % 3:
        ids[-1] = eos
    return ids


def fixed(trainer_cls):
    """``trainer_cls`` with generation replaced by :func:`completion_ids` (GRPO's and RLOO's signatures)."""

    returns_logprobs = "num_generations" in inspect.signature(trainer_cls._generate_single_turn).parameters

    class Fixed(trainer_cls):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
            low, high = (3, len(_WORDS.split())) if len(self._tokenizer) < 100 else (10, 4000)
            out = [completion_ids(i, list(p), self.eos_token_ids[0], low, high) for i, p in enumerate(prompt_ids)]
            return (out, None) if returns_logprobs else out  # GRPO: (ids, sampling log-probs); RLOO: ids

    Fixed.__name__ = f"Fixed{trainer_cls.__name__}"
    return Fixed


def reward(completion_ids, **kwargs) -> list[float]:
    return [float((sum(c) * 7 + len(c)) % 5) for c in completion_ids]


TEXT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@functools.lru_cache(maxsize=None)
def processor_of(family: str):
    """The word tokenizer (text families); the offline Qwen2-VL processor (Qwen-VL families, as
    tests/test_vlm_equivalence.py); the family's offline processor (vlm_pack.testing.tiny_families). Prompts are
    left-padded, as TRL's generation needs."""
    if family in TEXT_FAMILIES:
        return word_tokenizer()
    processor = offline_qwen2vl_processor() if family in _MODEL_CLASSES else tiny_vlm_processor(family)
    processor.tokenizer.padding_side = "left"
    return processor


def examples(family: str, n: int = 4) -> datasets.Dataset:
    """``n`` prompts; VLM prompts carry 1 or 2 images of different sizes."""
    photos = sample_photos()
    names = sorted(photos)
    rows = []
    for i in range(n):
        if family in TEXT_FAMILIES:
            rows.append({"prompt": [{"role": "user", "content": "what is shown in picture " + "? " * (i + 1)}]})
        else:
            images = [_fit(photos[names[(i + k) % len(names)]], SIDES[(i + k) % 4]) for k in range(1 + i % 2)]
            rows.append({"prompt": [{"role": "user", "content": f"What is shown in picture {i}?" + " Why?" * i}],
                         "images": images})
    return datasets.Dataset.from_list(rows)


def _tiny(family: str):
    vocab = len(_WORDS.split())
    if family == "mistral":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return MistralForCausalLM._from_config(mistral_text_config(vocab, layers=1), attn_implementation="sdpa",
                                                   dtype=torch.float32)
    if family in _MODEL_CLASSES:
        return tiny_model(family, layers=1, seed=0, vocab_size=vocab if family in TEXT_FAMILIES else None)
    return tiny_vlm(family, processor_of(family), layers=1, seed=0)


@functools.lru_cache(maxsize=None)
def _saved(family: str) -> tuple[str, type]:
    """The tiny policy saved once: TRL builds the reference model (beta > 0) from the policy's path."""
    path = tempfile.mkdtemp(prefix=f"vlm_pack_rl_{family}_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model = _tiny(family)
    model.save_pretrained(path)
    return path, type(model)


def policy(family: str):
    """A fresh copy of the saved tiny policy (fp32, sdpa), its ``_name_or_path`` pointing at the saved files."""
    path, model_class = _saved(family)
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


__all__ = ["G", "MAX_COMPLETION", "TEXT_FAMILIES", "GradientsAtStep", "examples", "fixed", "policy", "processor_of",
           "reward"]
