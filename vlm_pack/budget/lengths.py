"""Exact token count of every chat example after the processor, without decoding a single pixel.

A sample's length is its rendered chat text tokenised (one placeholder token per image or video) plus, per
image / video, the placeholder's expansion minus one (videos: from frame count and frame size). The expansion
comes from the processor's own rule (``processor._get_num_multimodal_tokens``, the hook vLLM uses: min/max
pixels, patch and merge size) applied to the image size read from the file header. Families whose processor
adds text around an image (Gemma 3's newlines and markers, Gemma 4's markers), counts multi-image samples
differently (LLaVA-OneVision) or has no such hook (SmolVLM) declare ``EncodingRules.image_text``: the placeholder
is replaced by that text and tokenised in context, as the processor does. Families whose expansion needs no image
size but rewrites the text around images (Idefics2) declare ``EncodingRules.expand_text``: the processor's own text
expansion gives the ids. ``TokenBudgetPackDataset`` checks
every planned length against the materialised one, so a family whose processor expands differently fails
loudly, never silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..core.versions import GAPS, has, installed
from ..data.chat import example_tools, image_size, normalize_example, template_messages
from ..data.chat_template import locate_turns
from ..models import require_proven

__all__ = ["SampleLengths", "measure_lengths", "require_budget_proof"]


@dataclass(frozen=True)
class SampleLengths:
    """Per-sample counts in dataset order (int64 ``[N]`` each): tokens after image/video/audio expansion, media
    tokens (image, video and audio tokens: the encoders' load), images + videos + audio clips."""

    tokens: np.ndarray
    image_tokens: np.ndarray
    images: np.ndarray

    def __post_init__(self) -> None:
        if not self.tokens.shape == self.image_tokens.shape == self.images.shape or self.tokens.ndim != 1:
            raise ValueError("tokens, image_tokens and images must be 1-D arrays of one entry per sample")


class _VisionTokenCounter:
    """Tokens per image size ``(h, w)`` or video size ``(frames, h, w)`` through the processor's own rule,
    memoised per distinct size."""

    def __init__(self, processor: Any, needed: bool = True) -> None:
        self._name = type(processor).__name__
        self._count = getattr(processor, "_get_num_multimodal_tokens", None)
        self._hop = getattr(getattr(processor, "feature_extractor", None), "hop_length", 1)
        if self._count is None and needed:
            raise ValueError(
                f"{self._name} cannot count image tokens from image sizes (no _get_num_multimodal_tokens) and its "
                "model family declares no image_text rule (vlm_pack/models/<family>.py): token-budget planning "
                "needs one of them to stay exact; pass the model's config as model_config= to the collator"
            )
        self._cache: dict[tuple[int, ...], int] = {}

    def __call__(self, sizes: list[tuple[int, ...]]) -> list[int]:
        missing = sorted({size for size in sizes if size not in self._cache})
        if missing and self._count is None:
            raise ValueError(f"{self._name} cannot count video tokens from video sizes (no "
                             "_get_num_multimodal_tokens): token-budget planning cannot plan videos for it")
        for kind, dims in (("image", 2), ("video", 3), ("audio", 1)):
            wanted = [size for size in missing if len(size) == dims]
            if wanted:
                try:
                    data = (self._count(audio_lengths=[self._whole_hops(size[0]) for size in wanted]) if kind == "audio"
                            else self._count(**{f"{kind}_sizes": [list(size) for size in wanted]}))
                except AttributeError as error:
                    if kind == "image" or has("video_token_count"):
                        raise
                    since = GAPS["video_token_count"].since
                    raise ValueError(f"{self._name} cannot count video tokens on transformers "
                                     f"{installed('transformers')} ({error}): token-budget planning of videos needs "
                                     f"pip install -U 'transformers>={since}'") from error
                self._cache.update(zip(wanted, (int(c) for c in data[f"num_{kind}_tokens"])))
        return [self._cache[size] for size in sizes]

    def _whole_hops(self, samples: int) -> int:
        """A clip's length rounded up to whole feature hops: the feature extractor's frame count (its frame mask
        has ``ceil(samples / hop)`` ones), which processors that floor the length (Qwen3-Omni) then count exactly."""
        hop = self._hop
        return -(-samples // hop) * hop


def measure_lengths(examples: Sequence[Any], collator: Any, *, batch_size: int = 512, num_proc: int = 1,
                    progress: bool = True) -> SampleLengths:
    """Exact per-sample counts of ``examples`` as ``collator`` (a ``VLMPackingCollator``) will encode them.

    Validation is the collator's (errors name the sample index); images are only opened for their header.
    ``num_proc > 1`` measures batches in that many forked worker processes (rendering the chat template is
    pure Python and dominates; the fast tokenizer is batched).
    """
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1; got {num_proc}")
    require_budget_proof(collator, "measure_lengths")
    starts = range(0, len(examples), batch_size)
    chunks = [(collator, examples[s:s + batch_size], s) for s in starts]
    bar = dict(desc="measuring", unit="batch", total=len(chunks), disable=not progress)
    if num_proc == 1 or len(chunks) == 1:
        parts = [_measure_chunk(*chunk) for chunk in tqdm(chunks, **bar)]
    else:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(num_proc) as pool:
            parts = list(tqdm(pool.imap(_measure_star, chunks), **bar))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return SampleLengths(empty, empty.copy(), empty.copy())
    return SampleLengths(*(np.concatenate(column) for column in zip(*parts)))


def require_budget_proof(collator: Any, what: str) -> None:
    """Refuse token-budget packs for a collator whose model family is not proven on them (``vlm_pack.models``;
    the collator's ``allow_unproven`` applies). A text collator without ``model_config`` has no family to check."""
    family = getattr(collator, "family", None)
    if family is not None:
        require_proven(family, "budget", what, allow_unproven=getattr(collator, "allow_unproven", False))


def _measure_star(args: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _measure_chunk(*args)


def _vision_size(part: dict, where: str) -> tuple[int, ...]:
    """``(h, w)`` of an image part from its header, ``(frames, h, w)`` of a video part from its frames' shape,
    ``(samples,)`` of an audio part."""
    if part["type"] == "image":
        return image_size(part["image"], where)
    if part["type"] == "audio":
        return (len(part["audio"]),)
    frames = part["video"]
    if isinstance(frames, (list, tuple)) and frames:
        return (len(frames), *image_size(frames[0], where))
    shape = getattr(frames, "shape", ())
    if len(shape) != 4:
        raise ValueError(f"{where}: video frames must be a T x H x W x C array or a list of frames")
    return int(shape[0]), int(shape[1]), int(shape[2])


def _measure_chunk(collator: Any, examples: Sequence[Any], first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, image tokens, images) of one batch of examples whose first has dataset index ``first``."""
    if collator.chat is None:
        return _measure_encoded(collator, examples, first)
    processor = collator.processor
    tokenizer = getattr(processor, "tokenizer", processor)
    image_text, expand_text = collator.encoding.image_text, collator.encoding.expand_text
    counter = (_VisionTokenCounter(processor, image_text is None and expand_text is None)
               if collator.has_images else None)
    conversations = [
        normalize_example(example, first + row, reserved_tokens=collator.reserved_tokens,
                          allow_images=collator.has_images, decode_images=False, allow_audio=collator.has_audio)
        for row, example in enumerate(examples)
    ]
    for row, conversation in enumerate(conversations):
        collator.check_media(conversation, first + row)
    rendered = [template_messages(conversation, not collator.has_images) for conversation in conversations]
    tools = [example_tools(example, first + row) for row, example in enumerate(examples)]
    # the collator's text (the template's rendering, plus a stop tag where TRL's training variant adds one)
    texts = [text for text, _ in locate_turns(processor, rendered, collator.chat, tools)]
    tokens, image_tokens, images = (np.zeros(len(examples), dtype=np.int64) for _ in range(3))
    for row, conversation in enumerate(conversations):
        where = f"sample {first + row}"
        turns = [(turn, part) for turn, message in enumerate(conversation) for part in message["content"]
                 if part["type"] != "text"]
        parts = [part for _, part in turns]
        if collator.encoding.video_runs == "frame" and any(p["type"] == "video" for p in parts):
            raise ValueError(
                f"{where}: token-budget planning cannot count a {collator.family.name} video: its processor writes a "
                "timestamp and markers around every frame, whose text depends on its frame sampling, not on the "
                "video's size alone; plan without video samples, or pack them by micro-batch (VLMPackingCollator)"
            )
        sizes = [_vision_size(part, f"{where}, turn {turn}") for turn, part in turns]
        if expand_text is not None:  # the processor's own text expansion counts the images (below)
            sizes = [size for size, part in zip(sizes, parts) if part["type"] != "image"]
        elif image_text is not None and any(part["type"] == "image" for part in parts):
            image_sizes = [size for size, part in zip(sizes, parts) if part["type"] == "image"]
            expanded = image_text(processor, image_sizes)
            texts[row] = _expand_images(texts[row], processor.image_token, [text for text, _ in expanded], where)
            image_tokens[row] += sum(count for _, count in expanded)
            sizes = [size for size, part in zip(sizes, parts) if part["type"] != "image"]
        per_part = counter(sizes) if sizes else []
        images[row] = len(parts)
        image_tokens[row] += sum(per_part)
        tokens[row] = sum(per_part) - len(sizes)  # each placeholder becomes its count of tokens
    if expand_text is not None:
        ids = expand_text(processor, texts)
        image_tokens += [int(np.count_nonzero(np.asarray(row) == processor.image_token_id)) for row in ids]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokens += [len(row) for row in ids]
    return tokens, image_tokens, images


def _measure_encoded(collator: Any, examples: Sequence[Any], first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts for a family with its own per-sample encoder (``EncodingRules.encode_sample``): that encoder run on each
    conversation with a blank image of each image's size (its token count depends on nothing else)."""
    from PIL import Image

    image_id = getattr(collator.processor, "image_token_id", None)
    tokens, image_tokens, images = (np.zeros(len(examples), dtype=np.int64) for _ in range(3))
    for row, example in enumerate(examples):
        where = f"sample {first + row}"
        conversation = normalize_example(example, first + row, reserved_tokens=collator.reserved_tokens,
                                         allow_images=collator.has_images, decode_images=False)
        blank = []
        for turn, message in enumerate(conversation):
            parts = []
            for part in message["content"]:
                if part["type"] == "image":
                    height, width = _vision_size(part, f"{where}, turn {turn}")
                    part = {**part, "image": Image.new("RGB", (width, height))}
                    images[row] += 1
                parts.append(part)
            blank.append({**message, "content": parts})
        ids = collator.encoding.encode_sample(collator.processor, blank, first + row)["input_ids"]
        tokens[row] = ids.shape[-1]
        image_tokens[row] = int((ids == image_id).sum()) if image_id is not None else 0
    return tokens, image_tokens, images


def _expand_images(text: str, placeholder: str, replacements: list[str], where: str) -> str:
    """``text`` with its image placeholders replaced in order, as the processor does before tokenising (so text
    the family puts around an image is tokenised in context, merges with its neighbours included)."""
    pieces = text.split(placeholder)
    if len(pieces) != len(replacements) + 1:
        raise ValueError(f"{where}: the chat template rendered {len(pieces) - 1} image placeholders "
                         f"{placeholder!r} for {len(replacements)} images; fix the template or the sample")
    return "".join(piece + replacement for piece, replacement in zip(pieces, replacements)) + pieces[-1]
