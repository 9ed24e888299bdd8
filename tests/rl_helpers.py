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

from preference_helpers import _WORDS, GradientsAtStep, word_tokenizer
from vlm_pack.testing.data import _fit, sample_photos
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


@functools.lru_cache(maxsize=None)
def processor_of(family: str):
    if family == "llama":
        return word_tokenizer()
    processor = offline_qwen2vl_processor()
    processor.tokenizer.padding_side = "left"
    return processor


def examples(family: str, n: int = 4) -> datasets.Dataset:
    """``n`` prompts; VLM prompts carry 1 or 2 images of different sizes."""
    photos = sample_photos()
    names = sorted(photos)
    rows = []
    for i in range(n):
        if family == "llama":
            rows.append({"prompt": [{"role": "user", "content": "what is shown in picture " + "? " * (i + 1)}]})
        else:
            images = [_fit(photos[names[(i + k) % len(names)]], SIDES[(i + k) % 4]) for k in range(1 + i % 2)]
            rows.append({"prompt": [{"role": "user", "content": f"What is shown in picture {i}?" + " Why?" * i}],
                         "images": images})
    return datasets.Dataset.from_list(rows)


@functools.lru_cache(maxsize=None)
def _saved(family: str) -> str:
    """The tiny policy saved once: TRL builds the reference model (beta > 0) from the policy's path."""
    path = tempfile.mkdtemp(prefix=f"vlm_pack_rl_{family}_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    vocab = len(_WORDS.split()) if family == "llama" else None
    tiny_model(family, layers=1, seed=0, vocab_size=vocab).save_pretrained(path)
    return path


def policy(family: str):
    """A fresh copy of the saved tiny policy (fp32, sdpa), its ``_name_or_path`` pointing at the saved files."""
    model = _MODEL_CLASSES[family].from_pretrained(_saved(family), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


__all__ = ["G", "MAX_COMPLETION", "GradientsAtStep", "examples", "fixed", "policy", "processor_of", "reward"]
