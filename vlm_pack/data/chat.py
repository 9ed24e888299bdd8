"""Chat examples -> token ids with assistant-only labels.

Label masking uses Hugging Face's own machinery: the chat template wraps each assistant turn in
``{% generation %} ... {% endgeneration %}``, ``apply_chat_template(return_assistant_tokens_mask=True)``
records those character spans, shifts them past the image-token expansion and maps them onto tokens through
the fast tokenizer's offsets. No string search on decoded text, no per-turn re-tokenisation (which can
tokenise differently at turn boundaries).

Accepted example forms (``messages`` may also be given as the example itself, a list of turns)::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": <PIL | path | bytes | array>},
                                                {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]}, ...],
     "images": [<image>]}                                   # image slots filled from "images", in order
    {"messages": [{"role": "user", "content": "<image>What is this?"}, ...], "images": [<image>]}
    {"messages": [{"role": "user", "content": [{"type": "video", "video": <frames>}, ...]}, ...]}
                                      # frames: a TxHxWxC array, or a list of HxWxC arrays / PIL images
    {"messages": [{"role": "user", "content": [{"type": "audio", "audio": <waveform>}, ...]}, ...]}
                                      # waveform: a 1-D float array at the processor's sampling rate
"""

from __future__ import annotations

import io
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from .chat_template import (
    ANSWER_FIELDS, CHATML_TEMPLATE, ChatTemplate, check_role, example_tools, render_with_assistant_masks,
    resolve_chat_template, takes_media,
)
from . import patch_index
from ..core.packing import IGNORE_INDEX
from ..core.versions import GAPS, has
from ..models import TEXT_ENCODING, EncodingRules, UnsupportedVersionError

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplate",
    "IMAGE_PLACEHOLDER",
    "carry_assistant_mask",
    "encode_conversations",
    "example_tools",
    "image_size",
    "load_image",
    "normalize_example",
    "resolve_chat_template",
    "template_messages",
]

# Placeholder for an image inside plain-string content (LLaVA / TRL convention), filled from example["images"].
IMAGE_PLACEHOLDER = "<image>"
# Per-video values some processors return as plain lists rather than tensors (Qwen2.5-VL's seconds per grid).
_PER_VIDEO_LISTS = ("second_per_grid_ts",)
# Marks a normalised turn whose message had no content (a tool-call turn): rendered without a content key.
NO_CONTENT = "vlm_pack_no_content"
# Keys an image part may carry its payload under (HF chat-template conventions plus raw bytes).
_IMAGE_KEYS = ("image", "url", "path", "bytes")

def load_image(value: Any, where: str) -> Image.Image:
    """Decode an image (PIL image, path, bytes, ``{"bytes"|"path": ...}`` or array) as 8-bit RGB.

    EXIF orientation is applied (``ImageOps.exif_transpose``) to files, bytes and PIL images, as transformers'
    own ``load_image`` does: a phone photo is trained upright. Pixel depth is scaled, never clipped: 16-bit data (``I;16`` PNGs, uint16 arrays) by 255/65535, float data in
    [0, 1] by 255 (rounded). Transparency is composited onto white, as ``transformers``' ``convert_to_rgb`` does.
    Anything whose scale is ambiguous (floats outside [0, 1] or not finite, wider integers beyond 255, 32-bit
    ``I``/``F`` images likewise) is refused with a ``ValueError`` naming ``where`` and the fix.
    """
    if isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
        return load_image(value.get("bytes") or value["path"], where)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, np.ndarray):
        return _array_to_rgb(value, where)
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(pathlib.Path(value))
        elif isinstance(value, (bytes, bytearray, memoryview)):
            image = Image.open(io.BytesIO(value))
        else:
            raise TypeError(f"unsupported image type {type(value).__name__}")
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode not in _WIDE_MODES:
            return _composite_rgb(image)
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ...); report them all the same way
        raise ValueError(
            f"{where}: image could not be read ({type(exc).__name__}: {exc}). Give a PIL image, an existing "
            "file path, encoded bytes (PNG/JPEG/...) or an HxWxC uint8 array."
        ) from exc
    return _array_to_rgb(np.asarray(image), where)


# PIL modes with more than 8 bits per pixel: converted through numpy so that depth is scaled, not saturated.
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _array_to_rgb(array: np.ndarray, where: str) -> Image.Image:
    """An HxW / HxWxC array (C = 1..4, any real dtype) -> RGB, with the depth rules of :func:`load_image`."""
    channels = 1 if array.ndim == 2 else array.shape[-1] if array.ndim == 3 else 0
    if channels not in (1, 2, 3, 4):  # grey, grey + alpha, RGB, RGBA
        raise ValueError(
            f"{where}: image array has shape {tuple(array.shape)}; expected HxW or HxWxC with C in 1..4 "
            "(channels last). For a CxHxW tensor pass tensor.permute(1, 2, 0)."
        )
    if array.size == 0:
        raise ValueError(f"{where}: image array has shape {tuple(array.shape)} (no pixels); drop the sample")
    array = array.reshape(array.shape[:2] + (channels,))
    if array.dtype == np.uint8:
        pixels = array
    elif array.dtype == np.bool_:
        pixels = array.astype(np.uint8) * 255
    elif array.dtype.kind == "u" and array.dtype.itemsize == 2:  # 16-bit, either byte order
        pixels = ((array.astype(np.uint32) + 128) // 257).astype(np.uint8)  # round(v * 255 / 65535)
    elif np.issubdtype(array.dtype, np.integer):
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > 255:
            raise ValueError(
                f"{where}: {array.dtype} image values span [{low}, {high}], outside the 8-bit range [0, 255]; "
                "convert to uint8 (or uint16 for 16-bit data) with the scaling your data needs"
            )
        pixels = array.astype(np.uint8)
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ValueError(f"{where}: float image contains NaN or infinity; fix or drop the sample")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(
                f"{where}: float image values span [{low:g}, {high:g}]; float pixels must lie in [0, 1]. Divide "
                "by 255 (data in 0..255) or convert to uint8 yourself"
            )
        pixels = np.floor(array.astype(np.float64) * 255.0 + 0.5).astype(np.uint8)
    else:
        raise ValueError(f"{where}: image array dtype {array.dtype} is not a pixel type; give uint8, uint16 or float")
    pixels = pixels[..., 0] if channels == 1 else pixels
    return _composite_rgb(Image.fromarray(np.ascontiguousarray(pixels)))  # L, LA, RGB or RGBA


def _composite_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (what ``transformers.image_transforms.convert_to_rgb`` does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def load_video(value: Any, where: str) -> np.ndarray:
    """Frames given as a ``T x H x W x C`` array/tensor or a list of frames (arrays or PIL) -> uint8 RGB array.

    Video files are not decoded here (that needs a video backend and a frame-sampling policy): decode them
    with your sampler and pass the frames.
    """
    if isinstance(value, (str, os.PathLike, bytes)):
        raise ValueError(
            f"{where}: video given as a file ({str(value)[:80]!r}); pass its decoded frames instead (a TxHxWxC "
            "uint8 array or a list of frames), sampled at the rate you train with"
        )
    try:
        if isinstance(value, (list, tuple)):
            frames = np.stack([np.asarray(load_image(frame, where)) for frame in value])
        else:
            frames = np.asarray(value)
            if frames.ndim != 4 or frames.shape[-1] not in (1, 3, 4):
                raise ValueError(f"expected T x H x W x C frames, got shape {frames.shape}")
            frames = np.stack([np.asarray(load_image(frame, where)) for frame in frames])
    except ValueError as exc:
        raise ValueError(f"{where}: video frames could not be read ({exc})") from exc
    if frames.shape[0] == 0:
        raise ValueError(f"{where}: video has no frames")
    return frames


def _as_messages(example: Any, index: int) -> tuple[list[Mapping], list[Any] | None]:
    if isinstance(example, Mapping):
        messages = example.get("messages", example.get("conversations"))
        images = example.get("images")
        if images is not None and not isinstance(images, Sequence):
            images = [images]
    else:
        messages, images = example, None
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(
            f"sample {index}: expected {{'messages': [{{'role': ..., 'content': ...}}, ...]}} (a non-empty list of "
            f"turns); got {type(messages).__name__}"
        )
    return list(messages), None if images is None else list(images)


def template_messages(turns: list[dict], text_only: bool) -> list[dict]:
    """Normalised turns as the chat template reads them: every field of the message as given (reasoning,
    ``tool_calls``, ``name``, ``tool_call_id``, ...), the content as parts (a processor) or one string (a text
    tokenizer, whose templates expect string content), and no content where the message had none."""
    messages = []
    for turn in turns:
        message = {key: value for key, value in turn.items() if key != NO_CONTENT}
        if turn.get(NO_CONTENT):
            del message["content"]
        elif text_only:
            message["content"] = "".join(part["text"] for part in turn["content"])
        messages.append(message)
    return messages


def normalize_example(
    example: Any, index: int, *, reserved_tokens: Sequence[str] = (), allow_images: bool = True,
    decode_images: bool = True, allow_audio: bool = False,
) -> list[dict]:
    """Validate one example and return its turns with list content and decoded PIL images, ready to render.

    Every other field of a message (``reasoning_content``, ``thinking``, ``tool_calls``, ``tool_call_id``,
    ``name``, ...) is kept as given: the chat template reads them (:func:`template_messages`).
    Errors name the sample (``index``) and the turn. Checks: roles and content types, at least one assistant
    turn with content (or tool calls / reasoning), image slots == images given, images decodable, no ``reserved_tokens`` (the processor's
    image/video placeholder tokens) typed inside text, where they would silently add image slots.
    ``decode_images=False`` leaves each image part's payload as given (planning reads only its header).
    ``allow_audio``: audio parts (``{"type": "audio", "audio": <1-D waveform>}``) are accepted (as float32 arrays);
    else refused, naming the paths that pack them.
    """
    messages, extra_images = _as_messages(example, index)
    pending = list(extra_images or [])
    slots = 0  # payload-less image parts, filled from example["images"] in order
    turns: list[dict] = []
    has_answer = False
    for turn_index, message in enumerate(messages):
        where = f"sample {index}, turn {turn_index}"
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"{where}: each turn needs 'role' and 'content' keys; got {message!r:.120}")
        check_role(message["role"], where)
        content = message.get("content")
        extras = {key: value for key, value in message.items() if key not in ("role", "content")}
        if content is None:  # OpenAI-style tool-call turns carry no content: the template sees none either
            if not message.get("tool_calls"):
                raise ValueError(f"{where}: each turn needs 'role' and 'content' keys; got {message!r:.120}")
            turns.append({"role": message["role"], "content": [], NO_CONTENT: True, **extras})
            has_answer = has_answer or message["role"] == "assistant"
            continue
        if isinstance(content, str):
            content = _split_placeholders(content) if extra_images is not None else [{"type": "text", "text": content}]
        elif not isinstance(content, Sequence):
            raise ValueError(f"{where}: content must be a string or a list of parts; got {type(content).__name__}")
        parts = [_normalize_part(part, where, reserved_tokens, allow_images, allow_audio) for part in content]
        for part in parts:
            if part["type"] == "image" and part["image"] is None:
                slots += 1
                part["image"] = pending.pop(0) if pending else None
        if message["role"] == "assistant" and (any(p["type"] != "text" or p["text"].strip() for p in parts) or any(
                message.get(key) for key in ANSWER_FIELDS)):
            has_answer = True
        turns.append({"role": message["role"], "content": parts, **extras})
    given = len(extra_images or [])
    if slots != given:
        raise ValueError(
            f"sample {index}: {slots} image placeholders but {given} images in 'images'; give exactly one image per "
            f"{IMAGE_PLACEHOLDER!r} / payload-less {{'type': 'image'}} part."
        )
    if not has_answer:
        raise ValueError(
            f"sample {index}: no assistant turn with content, so it has nothing to train on; add an "
            "{'role': 'assistant', 'content': ...} turn or filter such samples out."
        )
    for turn_index, turn in enumerate(turns):
        for part in turn["content"]:
            if part["type"] == "image" and decode_images:
                part["image"] = load_image(part["image"], f"sample {index}, turn {turn_index}")
            elif part["type"] == "video":
                part["video"] = load_video(part["video"], f"sample {index}, turn {turn_index}")
    return turns


def image_size(value: Any, where: str) -> tuple[int, int]:
    """``(height, width)`` of an image payload WITHOUT decoding its pixels (file and byte payloads: the header).

    Accepts what :func:`load_image` accepts; the size is the one ``load_image`` returns (EXIF orientation applied).
    """
    try:
        if isinstance(value, Image.Image):
            width, height = _oriented_size(value)
        elif isinstance(value, (str, os.PathLike)):
            with Image.open(pathlib.Path(value)) as image:
                width, height = _oriented_size(image)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(value)) as image:
                width, height = _oriented_size(image)
        elif isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
            return image_size(value.get("bytes") or value["path"], where)
        elif isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim in (2, 3):
            height, width = value.shape[:2]
        else:
            raise TypeError(f"unsupported image type {type(value).__name__}")
    except Exception as exc:
        raise ValueError(
            f"{where}: image size could not be read ({type(exc).__name__}: {exc}). Give a PIL image, an existing "
            "file path, encoded bytes (PNG/JPEG/...) or an HxWxC array."
        ) from exc
    return int(height), int(width)


# EXIF orientations that turn the picture by 90 degrees (transpose, 90 cw, transverse, 90 ccw): width and height swap.
_QUARTER_TURNS = (5, 6, 7, 8)


def _oriented_size(image: Image.Image) -> tuple[int, int]:
    """``(width, height)`` after ``ImageOps.exif_transpose``, read from the header."""
    width, height = image.size
    return (height, width) if image.getexif().get(0x0112) in _QUARTER_TURNS else (width, height)


def _normalize_part(part: Any, where: str, reserved_tokens: Sequence[str], allow_images: bool,
                    allow_audio: bool = False) -> dict:
    """One content part -> ``{"type": "text", "text": ...}``, ``{"type": "image", "image": payload | None}``,
    ``{"type": "video", "video": frames}`` or ``{"type": "audio", "audio": float32 waveform}``."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: a text part needs a string 'text'; got {part!r:.120}")
        for token in reserved_tokens:
            if token in text:
                raise ValueError(
                    f"{where}: text contains the reserved placeholder {token!r}; the processor would expand it as "
                    "a media slot without its media. Use a {'type': 'image'} ('video', 'audio') part instead."
                )
        return {"type": "text", "text": text}
    if kind == "image":
        if not allow_images:
            raise ValueError(
                f"{where}: has an image but the collator was built with a text tokenizer; pass the model's "
                "processor instead"
            )
        payload = next((part[key] for key in _IMAGE_KEYS if part.get(key) is not None), None)
        return {"type": "image", "image": payload}
    if kind == "video":
        if not allow_images:
            raise ValueError(
                f"{where}: has a video but the collator was built with a text tokenizer; pass the model's "
                "processor instead"
            )
        payload = next((part[key] for key in ("video", "path", "url") if part.get(key) is not None), None)
        if payload is None:
            raise ValueError(f"{where}: a video part needs its frames under 'video'")
        return {"type": "video", "video": payload}
    if kind == "audio":
        if not allow_audio:
            raise ValueError(
                f"{where}: unsupported content part of type 'audio' here: audio is packed only by VLMPackingCollator "
                "(and token-budget planning) with the audio processor of a model whose audio path is proven "
                "(docs/families.md); drop the audio part or train the sample unpacked"
            )
        if part.get("audio") is None:
            raise ValueError(f"{where}: an audio part needs its waveform under 'audio' (a 1-D float array)")
        return {"type": "audio", "audio": load_audio(part["audio"], where)}
    raise ValueError(f"{where}: unsupported content part {part!r:.120}; use type 'text', 'image', 'video' or 'audio'")


def load_audio(value: Any, where: str) -> np.ndarray:
    """A waveform (1-D array, tensor or list of floats, finite, non-empty) -> float32 array.

    Audio files are not decoded here (that needs an audio backend and a resampling policy): decode them at the
    processor's sampling rate (``processor.feature_extractor.sampling_rate``) and pass the samples.
    """
    if isinstance(value, (str, os.PathLike, bytes)):
        raise ValueError(f"{where}: audio given as a file ({str(value)[:80]!r}); pass its decoded waveform instead (a "
                         "1-D float array at the processor's sampling rate)")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().float().numpy()
    try:
        samples = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: audio could not be read as a waveform ({exc}); give a 1-D float array") from exc
    if samples.ndim != 1 or samples.size == 0:
        raise ValueError(f"{where}: audio has shape {samples.shape}; give one channel as a non-empty 1-D float array "
                         "(average the channels of a stereo clip yourself)")
    if not np.isfinite(samples).all():
        raise ValueError(f"{where}: audio contains NaN or infinity; fix or drop the sample")
    return samples


def _split_placeholders(text: str) -> list[dict]:
    """Plain-string content with ``<image>`` placeholders -> text parts and payload-less image slots."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts: list[dict] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def media_parts(turns: list[dict], kind: str) -> int:
    """How many content parts of ``kind`` (``"image"``, ``"video"`` or ``"audio"``) a normalised conversation holds."""
    return sum(part["type"] == kind for turn in turns for part in turn["content"])


def encode_conversations(
    processor: Any,
    conversations: list[list[dict]],
    chat_template: ChatTemplate,
    encoding: EncodingRules = TEXT_ENCODING,
    *,
    tools: Sequence[Any] | None = None,
    unlabelled_ids: Sequence[int] = (),
    unlabelled_spans: Sequence[tuple[int, int]] = (),
    image_token_id: int | None = None,
    patch_numbering: patch_index.Numbering = "call",
) -> list[dict[str, torch.Tensor]]:
    """Render and tokenise normalised conversations in ONE processor call; returns one dict per sample.

    One call is ~3x faster than one per sample (the processor's per-call overhead dominates small samples).
    Each dict holds the per-token tensors ``[1, L]`` (``input_ids``, ``labels``, ``mm_token_type_ids``, ...) and
    the sample's share of every vision tensor (``pixel_values`` rows, ``image_grid_thw`` rows, ...), present only
    if the sample has images or videos. Tokens are those of ``chat_template.template`` (the model's own, see
    :mod:`vlm_pack.data.chat_template`); ``labels`` equal ``input_ids`` on assistant tokens and -100 elsewhere. Image
    and video tokens never get labels: neither tokens the processor types as media (``mm_token_type_ids`` /
    ``token_type_ids`` != 0) nor ``unlabelled_ids`` nor any token of an ``unlabelled_spans`` span.

    Args:
        processor: the model's processor (or a text tokenizer).
        conversations: normalised conversations (:func:`normalize_example`), one per sample.
        chat_template: the resolved template (:func:`resolve_chat_template`) whose assistant spans give the labels.
        encoding: the family's :class:`~vlm_pack.models.EncodingRules`, read whole: how vision rows split between
            samples (``vision``: rows, tile tokens and stacks, width-packed and patch-index tensors), whether the
            processor's assistant mask is that of the unexpanded text (``mask_before_expansion``: carried onto the
            expanded tokens by :func:`carry_assistant_mask`, as for every processor on transformers < 5.23, which
            does not shift it; ``vlm_pack.core.versions.GAPS``), whether the processor takes one sample per call
            (``encode_alone``: the outputs are joined as one call's would be).
        tools: each conversation's chat-level tools (:func:`example_tools`).
        unlabelled_ids: ids that never carry labels (the placeholders and the family's ``media_tokens``).
        unlabelled_spans: ``(open id, close id)`` pairs; every token from an open through its close (both ends)
            never carries a label.
        image_token_id: the token each image expands into, whose count splits ``"image_token"`` vision rows
            (default: the processor's ``image_token_id``).
        patch_numbering: how the processor numbers ``vision.patch_indices``
            (:func:`vlm_pack.data.patch_index.numbering`): ``"call"`` (over the whole call: re-based per sample) or
            ``"image"`` (per image: each sample's share checked with ``vision.patch_image_offsets``).

    Returns:
        One dict per sample. If the processor fails, the error names the first sample it fails on.
    """
    vision_rules = encoding.vision
    tile_stacks, width_packed = vision_rules.tile_stacks, vision_rules.width_packed
    text_only = not takes_media(processor)  # text templates expect string content
    rendered = [template_messages(conversation, text_only) for conversation in conversations]
    tools = list(tools) if tools is not None else [None] * len(conversations)
    # A clip's features depend on the processor call (Qwen3-Omni pads the clips of a call to the longest, and the
    # Whisper frames at a clip's end see that padding): samples with audio are encoded alone, as each sample alone.
    audio_rows = tuple(key for key, unit in vision_rules.rows.items() if unit == "audio")
    encode_alone = encoding.encode_alone or any(media_parts(c, "audio") for c in conversations)
    try:
        out = (_apply_each(processor, rendered, chat_template, tools, audio_rows) if encode_alone
               else _apply_template(processor, rendered, chat_template, tools, bool(tile_stacks)))
    except Exception as batch_error:
        for index, conversation in enumerate(rendered):
            try:
                _apply_template(processor, [conversation], chat_template, [tools[index]], bool(tile_stacks))
            except Exception as exc:
                raise ValueError(f"sample {index}: {_reason(exc)}") from exc
        raise batch_error
    if encoding.mask_before_expansion:
        out["assistant_masks"] = _expanded_masks(processor, rendered, chat_template, out["input_ids"], unlabelled_ids,
                                                 tools)
    elif hasattr(processor, "image_processor") and not has("processor_mask_shift"):
        try:
            out["assistant_masks"] = _expanded_masks(processor, rendered, chat_template, out["input_ids"],
                                                     unlabelled_ids, tools)
        except ValueError as error:  # e.g. Qwen3-VL's timestamps between a video's frames
            since = GAPS["processor_mask_shift"].since
            raise UnsupportedVersionError(f"{error}; transformers >= {since} shifts the processor's own mask for expanded "
                             f"placeholders: pip install -U 'transformers>={since}'") from error
    images, videos, audios = ([media_parts(c, kind) for c in conversations] for kind in ("image", "video", "audio"))
    samples: list[dict[str, torch.Tensor]] = [{} for _ in conversations]
    # Per-image tensors some processors return as a list (Gemma 3's pixel_values): one row per image.
    out = {key: torch.cat([stack.unsqueeze(1) for stack in value]) if key in tile_stacks and _is_tensor_list(value)
           else torch.stack(value) if _is_tensor_list(value) else value for key, value in out.items()}
    vision = {key: torch.as_tensor(value) if key in _PER_VIDEO_LISTS else value
              for key, value in out.items() if isinstance(value, torch.Tensor) or key in _PER_VIDEO_LISTS}
    for key in width_packed:
        if key in vision:
            if vision[key].shape[0] != 1:
                raise ValueError(f"processor output {key!r} has shape {tuple(vision[key].shape)}: the family packs "
                                 "every image's patches into ONE row along the last dimension")
            vision[key] = vision[key][0].movedim(-1, 0)  # rows: positions along the patch dimension
    vision_rows = vision_rules.rows
    units = {vision_rows.get(key) for key in vision}  # a batch without images (or a text model) has none
    image_tokens = (_image_token_counts(processor, out["input_ids"], image_token_id)
                    if {"image_token", "tile"} & units else None)
    tile_tokens = vision_rules.tile_tokens
    tiles = tile_tokens(processor, vision) if "tile" in units and tile_tokens is not None else None
    split = _split_vision(vision, images, videos, vision_rows, image_tokens, tiles, audios)
    for key, source in vision_rules.patch_indices.items():
        if key in split:
            offsets = (None if patch_numbering == "call"
                       else patch_index.image_offsets_of(split, len(samples), vision_rules.patch_image_offsets))
            split[key] = patch_index.localize(split[key], split.get(source, [None] * len(samples)), key, source,
                                              offsets)
    for key, chunks in split.items():
        for sample, chunk in zip(samples, chunks):
            if chunk is not None:
                sample[key] = chunk.movedim(0, -1).unsqueeze(0) if key in width_packed else chunk
    media = torch.tensor(sorted(set(unlabelled_ids)), dtype=torch.long)
    for i, sample in enumerate(samples):
        for key, value in out.items():
            if not isinstance(value, torch.Tensor) and key not in ("attention_mask", *_PER_VIDEO_LISTS):
                sample[key] = torch.tensor(value[i], dtype=torch.long).unsqueeze(0)
        assistant = sample.pop("assistant_masks").bool() & ~torch.isin(sample["input_ids"], media)
        for open_id, close_id in unlabelled_spans:
            assistant &= ~_inside_spans(sample["input_ids"], open_id, close_id)
        for media_key in ("mm_token_type_ids", "token_type_ids"):  # media tokens never get labels
            if media_key in sample:
                assistant &= sample[media_key] == 0
        sample["labels"] = sample["input_ids"].masked_fill(~assistant, IGNORE_INDEX)
    return samples


def _expanded_masks(
    processor: Any, conversations: list[list[dict]], chat_template: ChatTemplate,
    expanded: Sequence[Sequence[int]], media_ids: Sequence[int], tools: Sequence[Any],
) -> list[list[int]]:
    """Assistant masks of the processor's ``expanded`` ids, carried from the chats tokenised by the tokenizer alone
    (the template's text, each image placeholder one token), whose mask is exact."""
    before = render_with_assistant_masks(processor.tokenizer, conversations, chat_template, tools)
    return [carry_assistant_mask(ids, mask, after, set(media_ids), f"sample {index}")
            for index, (ids, mask, after) in enumerate(zip(before["input_ids"], before["assistant_masks"], expanded))]


def carry_assistant_mask(
    before: Sequence[int], mask: Sequence[int], after: Sequence[int], media_ids: set[int], where: str
) -> list[int]:
    """The assistant ``mask`` of token ids ``before`` placeholder expansion, carried onto ``after`` (the ids the
    processor wrote); fails closed with a ``ValueError`` naming ``where``.

    Both sequences are cut into text runs at their runs of ``media_ids`` (the placeholder and its markers): the
    k-th media run of ``after`` is the expansion of the k-th of ``before``, and media tokens get no mask. Equal text
    runs map one to one. A processor may rewrite only the START of a text run (Idefics2 puts a space before text
    that follows an image, which re-tokenises its first word; a tokenizer may add a BOS): the tokens past the
    longest common tail map one to one, the rewritten head takes the mask of the tokens it replaces (which must
    agree) or, where it only adds tokens, that of the first token after it. Anything else is refused.
    """
    runs_before, runs_after = _text_runs(before, media_ids), _text_runs(after, media_ids)
    if len(runs_before) != len(runs_after):
        raise ValueError(
            f"{where}: the processor wrote {len(runs_after) - 1} image runs for {len(runs_before) - 1} runs of image "
            "placeholders in the chat, so the assistant mask cannot be carried through its expansion"
        )
    carried = [0] * len(after)
    for (b0, b1), (a0, a1) in zip(runs_before, runs_after):
        tail = 0
        while tail < min(b1 - b0, a1 - a0) and before[b1 - 1 - tail] == after[a1 - 1 - tail]:
            tail += 1
        head_before, head_after = range(b0, b1 - tail), range(a0, a1 - tail)
        for offset in range(tail):
            carried[a1 - 1 - offset] = int(mask[b1 - 1 - offset])
        if not head_after:
            if head_before:
                raise ValueError(f"{where}: the processor dropped text tokens {list(before[b0:b1 - tail])} of the "
                                 "chat, so the assistant mask cannot be carried through its expansion")
            continue
        source = {int(mask[i]) for i in head_before} if head_before else {int(mask[b1 - tail])} if tail else set()
        if len(source) != 1:
            raise ValueError(
                f"{where}: the processor re-tokenised text {list(before[b0:b1 - tail])} -> "
                f"{list(after[a0:a1 - tail])} across an assistant-turn border (or added tokens to an empty text run), "
                "so the assistant mask cannot be carried through its expansion"
            )
        value = source.pop()
        for i in head_after:
            carried[i] = value
    return carried


def _text_runs(ids: Sequence[int], media_ids: set[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each text run of ``ids`` around its maximal runs of ``media_ids`` (media runs + 1)."""
    runs, start = [], 0
    for i, token in enumerate(ids):
        if token in media_ids:
            if i == 0 or ids[i - 1] not in media_ids:
                runs.append((start, i))
            start = i + 1
    runs.append((start, len(ids)))
    return runs


def _inside_spans(ids: torch.Tensor, open_id: int, close_id: int) -> torch.Tensor:
    """True from each ``open_id`` through the next ``close_id`` (both included), along the last dimension."""
    opens, closes = (ids == open_id).long(), (ids == close_id).long()
    return (opens.cumsum(-1) - closes.cumsum(-1) + closes) > 0


def _reason(exc: Exception) -> str:
    """A sample's rendering error: ours as is (it names the template and fix), else the processor's."""
    text = str(exc)
    return text.removeprefix("sample 0: ") if text.startswith("sample 0: ") else f"the processor rejected it: {text}"


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def _apply_template(
    processor: Any, conversations: list[list[dict]], chat_template: ChatTemplate, tools: Sequence[Any],
    image_lists: bool = False,
) -> Mapping[str, Any]:
    # Vision outputs as tensors (some image processors return lists by default); token ids stay per-sample lists
    # (some processors default to tensors for text too, which fails on samples of different lengths) and unpadded
    # (Aya Vision's processor left-pads by default: pad tokens would enter the packed row). The top-level
    # return_tensors stays "auto" (no global override; SmolVLM's own default would clash).
    images = takes_media(processor)
    # image_lists: one tensor per image, unstacked (tile stacks of different lengths, VisionRows.tile_stacks).
    per_kind = {"images_kwargs": {"return_tensors": None if image_lists else "pt"},
                "text_kwargs": {"return_tensors": None, "padding": False}}
    if hasattr(processor, "feature_extractor"):  # audio features as tensors too (one row per clip)
        per_kind["audio_kwargs"] = {"return_tensors": "pt"}
    tensors = {"processor_kwargs": per_kind} if images else {}
    if images and has("chat_template_auto_tensors"):  # older releases forward nothing when it is left out
        tensors["return_tensors"] = "auto"
    return render_with_assistant_masks(processor, conversations, chat_template, tools, **tensors)


def _apply_each(
    processor: Any, conversations: list[list[dict]], chat_template: ChatTemplate, tools: Sequence[Any],
    audio_rows: Sequence[str] = (),
) -> dict[str, Any]:
    """``_apply_template`` one sample at a time, joined: tensors (vision rows) concatenated in sample order,
    per-sample lists (token ids, masks) extended. ``audio_rows`` (one row per clip, frames along the last
    dimension, read through ``feature_attention_mask``): each call's clips right-padded with zeros to the widest."""
    parts = [_apply_template(processor, [turns], chat_template, [tool]) for turns, tool in zip(conversations, tools)]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(key for part in parts for key in part):
        values = [part[key] for part in parts if key in part]
        if key in audio_rows:
            width = max(value.shape[-1] for value in values)
            values = [torch.nn.functional.pad(value, (0, width - value.shape[-1])) for value in values]
        out[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else [v for value in values for v in value]
    return out


def _image_token_counts(processor: Any, input_ids: Sequence[Sequence[int]], image_token: int | None) -> list[int]:
    """Image tokens per sample (``image_token``, else ``processor.image_token_id``)."""
    image_token = getattr(processor, "image_token_id", None) if image_token is None else image_token
    if not isinstance(image_token, int):
        raise ValueError("the processor has no integer image_token_id, needed to split vision rows per image token")
    return [int(np.count_nonzero(np.asarray(ids) == image_token)) for ids in input_ids]


def _split_vision(
    vision: dict[str, torch.Tensor],
    images: list[int],
    videos: list[int],
    vision_rows: Mapping[str, str],
    image_tokens: list[int] | None = None,
    tile_tokens: list[int] | None = None,
    audios: list[int] | None = None,
) -> dict[str, list[torch.Tensor | None]]:
    """Attribute each batched vision tensor's rows to samples; samples without rows get None.

    Keys naming a video (``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``) belong to the
    videos, keys declared ``"audio"`` in ``vision_rows`` (one row per audio clip: ``input_features``,
    ``feature_attention_mask``) to the ``audios`` (clips per sample), the others to the images. Patch rows
    (``pixel_values`` / ``pixel_values_videos`` next to their ``*_grid_thw``) are split by the grid; keys in
    ``vision_rows`` follow their declared unit (see ``vlm_pack.models.RowUnit``); any other tensor with one row
    per image (video) is split by image (video), one with one row per sample, by sample.
    """
    split = {}
    for key, value in vision.items():
        is_video = "video" in key or key == "second_per_grid_ts"
        unit = vision_rows.get(key)
        per_sample = (audios or [0] * len(images)) if unit == "audio" else videos if is_video else images
        grid = vision.get("video_grid_thw" if is_video else "image_grid_thw")
        owner = np.repeat(np.arange(len(per_sample)), per_sample)  # sample index of every image / video / clip
        rows = value.shape[0] if value.dim() else -1
        if key in ("pixel_values", "pixel_values_videos") and grid is not None:
            weights = grid.prod(-1).numpy()
            counts = np.bincount(owner, weights=weights, minlength=len(per_sample)).astype(int).tolist()
        elif unit == "sample_with_images":
            counts = [int(n > 0) for n in per_sample]
        elif unit == "image_token":
            counts = _proportional(key, rows, image_tokens)
        elif unit == "tile":
            counts = _tiles(key, rows, image_tokens, tile_tokens)
        elif unit == "sample" or (unit is None and rows != len(owner) and rows == len(per_sample)):
            counts = [1] * len(per_sample)
        else:  # one row per image (video, audio clip), declared or inferred
            counts = per_sample
        if sum(counts) != rows:
            kind = "audio clips" if unit == "audio" else "videos" if is_video else "images"
            expected = f"one row per {unit}" if unit else f"the {len(owner)} {kind} or {len(per_sample)} samples"
            raise ValueError(
                f"processor output {key!r} has shape {tuple(value.shape)}, which does not match {expected}; the "
                "collator cannot split it per sample (declare its rows in the family's VisionRows.rows)"
            )
        split[key] = [chunk if count else None for chunk, count in zip(torch.split(value, counts), counts)]
    return split


def _tiles(key: str, rows: int, image_tokens: list[int], tile_tokens: list[int] | None) -> list[int]:
    """Rows per sample when each row is a tile of ``tile_tokens[row]`` image tokens (tiles of different sizes, in
    sample order): each sample takes the next tiles whose tokens add up to its own image tokens."""
    if tile_tokens is None or len(tile_tokens) != rows:
        raise ValueError(f"processor output {key!r} has {rows} rows but the family's tile_tokens gave "
                         f"{None if tile_tokens is None else len(tile_tokens)} tile token counts")
    ends = np.cumsum(tile_tokens)
    bounds = np.searchsorted(ends, np.cumsum(image_tokens), side="right")
    if bounds[-1] != rows or not np.array_equal(np.concatenate([[0], ends])[bounds], np.cumsum(image_tokens)):
        raise ValueError(f"processor output {key!r}: its tiles' image tokens do not add up to each sample's image "
                         "tokens, so the collator cannot split it per sample")
    return np.diff(np.concatenate([[0], bounds])).tolist()


def _proportional(key: str, rows: int, image_tokens: list[int]) -> list[int]:
    """Rows per sample when ``rows`` are in a fixed ratio to the samples' image tokens (e.g. tiles per image, or
    patch columns per image token)."""
    total = sum(image_tokens)
    if total and rows % total == 0:  # a whole number of rows per token
        return [n * (rows // total) for n in image_tokens]
    if rows == 0 or total % rows:
        raise ValueError(
            f"processor output {key!r} has {rows} rows for {total} image tokens: not a whole number of tokens per "
            "row, so the collator cannot split it per sample"
        )
    per_row = total // rows
    if any(n % per_row for n in image_tokens):
        raise ValueError(f"processor output {key!r}: a sample's image tokens are not a multiple of {per_row} per row")
    return [n // per_row for n in image_tokens]
