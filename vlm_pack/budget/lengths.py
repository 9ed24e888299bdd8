"""Exact token count of every chat example after the processor, without decoding a single pixel.

A sample's length is its rendered chat text tokenised (one placeholder token per image) plus, per image, the
placeholder's expansion minus one. The expansion comes from the processor's own rule
(``processor._get_num_multimodal_tokens``, the hook vLLM uses: min/max pixels, patch and merge size) applied to
the image size read from the file header. ``TokenBudgetPackDataset`` checks every planned length against the
materialised one, so a family whose processor expands differently fails loudly, never silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..chat import image_size, normalize_example

__all__ = ["SampleLengths", "measure_lengths"]


@dataclass(frozen=True)
class SampleLengths:
    """Per-sample counts in dataset order (int64 ``[N]`` each): tokens after image expansion, image tokens,
    images."""

    tokens: np.ndarray
    image_tokens: np.ndarray
    images: np.ndarray

    def __post_init__(self) -> None:
        if not self.tokens.shape == self.image_tokens.shape == self.images.shape or self.tokens.ndim != 1:
            raise ValueError("tokens, image_tokens and images must be 1-D arrays of one entry per sample")


class _ImageTokenCounter:
    """Tokens per image size through the processor's own rule, memoised per distinct (height, width)."""

    def __init__(self, processor: Any) -> None:
        count = getattr(processor, "_get_num_multimodal_tokens", None)
        if count is None:
            raise ValueError(
                f"{type(processor).__name__} cannot count image tokens from image sizes (no "
                "_get_num_multimodal_tokens): token-budget planning needs it to stay exact"
            )
        self._count = count
        self._cache: dict[tuple[int, int], int] = {}

    def __call__(self, sizes: list[tuple[int, int]]) -> list[int]:
        missing = sorted({size for size in sizes if size not in self._cache})
        if missing:
            counts = self._count(image_sizes=[list(size) for size in missing]).num_image_tokens
            self._cache.update(zip(missing, (int(c) for c in counts)))
        return [self._cache[size] for size in sizes]


def measure_lengths(examples: Sequence[Any], collator: Any, *, batch_size: int = 512,
                    progress: bool = True) -> SampleLengths:
    """Exact per-sample counts of ``examples`` as ``collator`` (a ``VLMPackingCollator``) will encode them.

    Validation is the collator's (errors name the sample index); images are only opened for their header.
    """
    processor = collator.processor
    tokenizer = getattr(processor, "tokenizer", processor)
    counter = _ImageTokenCounter(processor) if collator.has_images else None
    tokens, image_tokens, images = (np.zeros(len(examples), dtype=np.int64) for _ in range(3))
    for start in tqdm(range(0, len(examples), batch_size), desc="measuring", unit="batch", disable=not progress):
        chunk = range(start, min(start + batch_size, len(examples)))
        conversations = [
            normalize_example(examples[i], i, reserved_tokens=collator.reserved_tokens,
                              allow_images=collator.has_images, decode_images=False)
            for i in chunk
        ]
        texts = processor.apply_chat_template(conversations, chat_template=collator.chat_template, tokenize=False)
        text_lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        for row, (index, conversation) in enumerate(zip(chunk, conversations)):
            sizes = [
                image_size(part["image"], f"sample {index}, turn {turn}")
                for turn, message in enumerate(conversation)
                for part in message["content"] if part["type"] == "image"
            ]
            per_image = counter(sizes) if sizes else []
            images[index] = len(sizes)
            image_tokens[index] = sum(per_image)
            tokens[index] = text_lengths[row] + image_tokens[index] - len(sizes)
    return SampleLengths(tokens, image_tokens, images)
