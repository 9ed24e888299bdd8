"""``VLMPackingCollator``: chat examples -> one packed row (or a padded batch) that HF VLMs train on exactly.

Per micro-batch::

    examples --normalize/decode images--> turns --processor.apply_chat_template--> per-sample tensors
             (input_ids, labels on assistant tokens only, mm_token_type_ids, pixel_values, image_grid_thw)
             --right-pad [B, S]--> per-sample positions (text + mRoPE rows, via the model's get_rope_index)
             --pack_batch_sequences--> input_ids/labels [1, T], position_ids [4, 1, T] (mRoPE) or [1, T],
                                       cu_seq_lens_q/k + max_length_q/k, vision tensors in sample order
    (models without mRoPE skip the padded batch: per-sample tensors --pack_sequences--> the same row)

The packed batch carries NO ``attention_mask``: with one, HF's own packed-boundary detection switches off
and samples attend to each other (sdpa / eager / flash without ``cu_seq_lens``). The batch is model-ready
(``vlm_pack.core.batch``): ``model(**batch)`` is exact, bookkeeping sits in ``batch["vlm_pack"]`` (``cu_seqlens``,
``cu_seqlens_padded``, ``seq_lengths``, ``stats``), and the first label of every sample is -100. Custom loops
feed ``model_inputs(batch)`` and compute the loss with ``vlm_pack.core.loss`` on ``batch["labels"]`` /
``batch["cu_seq_lens_q"]`` (labels are unshifted; the shift happens inside each sample).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from transformers.configuration_utils import PreTrainedConfig

from ..core.batch import METADATA_KEY, mask_first_labels, model_inputs
from . import patch_index
from .chat import encode_conversations, example_tools, media_parts, normalize_example, resolve_chat_template
from .chat_template import with_prefix
from ..core.config import PackingConfig
from ..core.packing import IGNORE_INDEX, PackedBatch, pack_batch_sequences, pack_sequences, pad_multiple
from ..models import TEXT_ENCODING, EncodingRules, FamilySpec, UnsupportedVersionError, get_family, require_proven
from ..core.rope_index import MRopeIndex
from ..core.versions import GAPS, has, installed

__all__ = ["CollatorStats", "TOKEN_ALIGNED_KEYS", "VLMPackingCollator", "model_inputs"]

# Per-token keys of a text tokenizer collator (no model_config): padded / packed exactly like input_ids. With a
# model_config the family registry says which keys are per token. Every other tensor a processor returns
# (pixel_values, image_grid_thw, video tensors, ...) is per sample: concatenated along dim 0 in sample order.
TOKEN_ALIGNED_KEYS = TEXT_ENCODING.token_keys
_TOKEN_FILL = {"labels": IGNORE_INDEX}
_PACKED_KEYS = ("input_ids", "labels")  # packed by the core itself; other per-token keys scatter into real slots


@dataclass
class CollatorStats:
    """Counts for one collated batch (also in ``batch["vlm_pack"]["stats"]``, which survives DataLoader workers).

    ``padded_slots``: alignment slots in packed mode, right-padding slots in padded mode.
    Wall times: ``encode_s`` rendering, image decoding and the processor; ``batch_s`` right-padding to
    ``[B, S]`` and concatenating vision tensors (the same in both modes); ``positions_s`` per-sample mRoPE
    positions (a per-sample feature: an unpacked model computes the same in its forward); ``pack_s`` the
    packing itself (``pack_batch_sequences`` and the packed per-token keys; 0 in padded mode).
    """

    samples: int
    samples_dropped: int
    real_tokens: int
    label_tokens: int
    padded_slots: int
    images: int
    image_tokens: int
    encode_s: float
    batch_s: float
    positions_s: float
    pack_s: float

    @property
    def padding_fraction(self) -> float:
        """Share of the batch's slots that carry no real token."""
        total = self.real_tokens + self.padded_slots
        return self.padded_slots / total if total else 0.0


class VLMPackingCollator:
    """Picklable ``collate_fn``: chat examples -> one packed row (default) or a right-padded batch.

    ``processor``: a HF multimodal processor (Qwen2-VL family, ...) or, for text-only LLMs, a tokenizer.
    ``max_length``: longest sample allowed (tokens after image expansion). Longer samples raise
    (``on_overlong="error"``) or are dropped with a counted warning (``"drop"``); they are never truncated,
    since cutting would split an image's tokens from its pixels.
    ``context_parallel_size`` / ``tensor_parallel_size`` / ``sequence_parallel``: each sequence is padded to
    ``pad_multiple(cp, tp, sp)`` so the row splits evenly across ranks. ``pad_to_length``: a fixed packed width
    (static shapes; the extra slots form one trailing fill segment).
    ``model_config``: ``model.config`` of the model to train. Its family (``vlm_pack.models``) fixes the position
    rule (e.g. mRoPE computed per sample with the model's own rope index) and the per-token processor keys; an
    unregistered family or unhandled feature is refused unless ``allow_unproven=True``. Required with a
    multimodal processor; optional with a text tokenizer (then positions restart at 0 per sample).
    ``chat_template``: the template to render with (default: the processor's own). Tokens are always that
    template's; assistant spans come from its ``{% generation %}`` blocks, TRL's training variant of it, the
    rendered text's markup, per-message sentinels or prefix renderings (``vlm_pack.data.chat_template``); a template
    none of them can label is refused here, naming the feature. Every message field the template reads is passed
    through (reasoning, tool calls, tool responses, names), and an example's ``tools`` reach it as ``tools=``.
    ``template_kwargs``: chat-level template variables for every sample (e.g. ``{"enable_thinking": False}``).
    ``on_empty``: a sample left without any label (e.g. an empty answer once rendered) raises (``"error"``) or is
    dropped with a counted warning (``"drop"``); a batch without any label always raises.
    """

    def __init__(
        self,
        processor: Any,
        *,
        max_length: int,
        pack_sequences_in_batch: bool = True,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        model_config: PreTrainedConfig | None = None,
        on_overlong: Literal["error", "drop"] = "error",
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        allow_unproven: bool = False,
        pad_to_length: int | None = None,
        on_empty: Literal["error", "drop"] = "error",
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1; got {max_length}")
        for name, value in (("on_overlong", on_overlong), ("on_empty", on_empty)):
            if value not in ("error", "drop"):
                raise ValueError(f"{name} must be 'error' or 'drop'; got {value!r}")
        self.processor = processor
        self.max_length = max_length
        self.pack_sequences_in_batch = pack_sequences_in_batch
        self.pad_to_multiple_of = pad_multiple(context_parallel_size, tensor_parallel_size, sequence_parallel)
        self.on_overlong = on_overlong
        self.on_empty = on_empty
        self.pad_to_length = pad_to_length
        if model_config is None:  # a text tokenizer on its own: no family, a text model's encoding
            self.family: FamilySpec | None = None
            self.encoding: EncodingRules = TEXT_ENCODING
            self.model_name = "a text model"
        else:
            self.family = get_family(model_config, allow_unproven=allow_unproven)
            self.encoding = self.family.encoding
            self.model_name = f"the {self.family.name} family"
        if self.encoding.encode_sample is not None:
            if chat_template is not None or template_kwargs:
                raise ValueError(f"{self.model_name} encodes each sample by its processor's own rule "
                                 "(vlm_pack.models), not by a chat template: drop chat_template / template_kwargs")
            self.chat = self.chat_template = None
        else:
            self.chat = resolve_chat_template(processor, chat_template, template_kwargs)  # how spans are found
            if self.encoding.template_prefix is not None:
                self.chat = with_prefix(processor, self.chat, self.encoding.template_prefix(processor))
            self.chat_template = self.chat.template  # the template every sample is rendered (tokenised) with
        self.has_images = hasattr(processor, "image_processor")
        self.has_audio = any(hasattr(processor, name) for name in ("feature_extractor", "audio_processor"))
        tokenizer = getattr(processor, "tokenizer", processor)
        self.pad_token_id = _pad_id(tokenizer) if pad_token_id is None else pad_token_id
        placeholders = tuple(getattr(processor, f"{kind}_token", None) for kind in ("image", "video", "audio"))
        self.reserved_tokens = tuple(token for token in placeholders if token)
        if model_config is None and (self.has_images or self.has_audio):
            raise ValueError(
                "the collator got a multimodal processor but no model_config: pass model_config=model.config, so "
                "positions and per-token keys follow the model's family (e.g. mRoPE computed per sample)"
            )
        if (self.has_images and self.encoding.expansion_writes_text and not self.encoding.mask_before_expansion
                and not has("processor_mask_shift")):
            since = GAPS["processor_mask_shift"].since
            raise UnsupportedVersionError(
                f"the {self.family.name} processor writes text inside its image expansion, so its assistant mask (the "
                f"labels) is right only from transformers {since} on, which shifts it for expanded placeholders "
                f"(found transformers {installed('transformers')}); pip install -U 'transformers>={since}'"
            )
        self.image_token_id = _image_token_id(processor, self.encoding)
        self.unlabelled_ids = _media_token_ids(processor, self.encoding)
        self.unlabelled_spans = _media_span_ids(processor, self.encoding)
        self.allow_unproven = allow_unproven
        if context_parallel_size > 1:
            require_proven(self.family, "context_parallel", f"context_parallel_size={context_parallel_size}",
                           allow_unproven=allow_unproven)
        self.token_keys = self.encoding.token_keys
        self.rope_index = (MRopeIndex(model_config, self.encoding.positions.rope_index_model)
                           if self.encoding.positions.rule == "mrope" else None)
        if self.rope_index is not None and self.has_images:
            merge = getattr(processor.image_processor, "merge_size", None)
            if merge is not None and merge != self.rope_index.spatial_merge_size:
                raise ValueError(
                    f"processor.image_processor.merge_size={merge} but model_config.vision_config."
                    f"spatial_merge_size={self.rope_index.spatial_merge_size}: processor and model do not match"
                )
        self.patch_numbering = self._patch_numbering()
        self.last_stats: CollatorStats | None = None

    def _patch_numbering(self) -> patch_index.Numbering:
        """How the processor numbers the family's patch indices (:func:`vlm_pack.data.patch_index.numbering`);
        numbered per image needs the family's ``VisionRows.patch_image_offsets`` (where each image starts in its sample)."""
        vision = self.encoding.vision
        if not vision.patch_indices or not self.has_images:
            return "call"
        (key, source), = vision.patch_indices.items()
        found = patch_index.numbering(self.processor.image_processor, key, source)
        if found == "image" and vision.patch_image_offsets is None:
            raise ValueError(f"{self.model_name}'s processor numbers {key!r} per image, and the family declares no "
                             "patch_image_offsets (vlm_pack/models/<family>.py): its patches cannot be packed")
        return found

    @classmethod
    def from_config(cls, processor: Any, config: PackingConfig, **kwargs: Any) -> "VLMPackingCollator":
        """Build from a validated :class:`PackingConfig` (max length, packing flag and parallel layout)."""
        return cls(
            processor,
            max_length=config.seq_length,
            pack_sequences_in_batch=config.pack_sequences_in_batch,
            context_parallel_size=config.context_parallel_size,
            tensor_parallel_size=config.tensor_parallel_size,
            sequence_parallel=config.sequence_parallel,
            **kwargs,
        )

    def __call__(self, examples: Sequence[Any]) -> dict[str, Any]:
        if not isinstance(examples, Sequence) or isinstance(examples, (str, bytes)):
            raise TypeError(f"the collator takes a list of examples (a batch), got a {type(examples).__name__}; "
                            "wrap a single example in a list: collator([example])")
        if len(examples) == 0:
            raise ValueError(
                "empty batch: the collator got no examples. Check the dataset/sampler (drop_last, filtering)."
            )
        clock = [time.perf_counter()]
        samples, dropped, images = self._encode_all(examples)
        clock.append(time.perf_counter())
        # Without mRoPE there are no positions to compute on a padded batch: pack straight from the samples.
        direct = self.pack_sequences_in_batch and self.rope_index is None
        if not direct:
            longest = max(s["input_ids"].shape[1] for s in samples)
            padded = self._padded(samples, -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of)
        vision = self._per_sample_keys(samples)
        clock.append(time.perf_counter())
        if direct:
            clock.append(time.perf_counter())
            batch = self._pack_samples(samples, vision)
        elif self.pack_sequences_in_batch:
            positions = self._positions(samples, padded, vision)
            clock.append(time.perf_counter())
            batch = self._pack(padded, vision, positions)
        else:  # an ordinary batch: the model derives (mRoPE) positions of a padded batch itself
            clock.append(time.perf_counter())
            batch = {**padded, **vision, METADATA_KEY: {}}
            batch["labels"][:, 0] = IGNORE_INDEX  # as in packed mode: a row's first token is never a target
        clock.append(time.perf_counter())
        timings = dict(zip(("encode_s", "batch_s", "positions_s", "pack_s"), np.diff(clock).tolist()))
        stats = self._stats(batch, samples, dropped, images, timings)
        batch[METADATA_KEY]["stats"] = stats
        self.last_stats = stats
        return batch

    # ---------------------------------------------------------------- encoding

    def _encode_all(self, examples: Sequence[Any]) -> tuple[list[dict[str, torch.Tensor]], list[int], int]:
        """(encoded samples that fit, indices of the dropped ones, images in the samples that fit)."""
        conversations = [
            normalize_example(example, index, reserved_tokens=self.reserved_tokens, allow_images=self.has_images,
                              allow_audio=self.has_audio)
            for index, example in enumerate(examples)
        ]
        for index, turns in enumerate(conversations):
            self.check_media(turns, index)
        samples, dropped, images = [], [], 0
        if self.chat is None:  # the family's own per-sample encoder (EncodingRules.encode_sample)
            encoded = [self.encoding.encode_sample(self.processor, turns, index)
                       for index, turns in enumerate(conversations)]
        else:
            tools = [example_tools(example, index) for index, example in enumerate(examples)]
            encoded = encode_conversations(self.processor, conversations, self.chat, self.encoding, tools=tools,
                                           unlabelled_ids=self.unlabelled_ids, unlabelled_spans=self.unlabelled_spans,
                                           image_token_id=self.image_token_id,
                                           patch_numbering=self.patch_numbering)
        if self.rope_index is not None:
            for index, features in enumerate(encoded):
                _check_video_runs(features, self.processor, self.encoding.video_runs, self.family.name,
                                  self.rope_index.spatial_merge_size, index)
        empty = []
        for index, features in enumerate(encoded):
            length = features["input_ids"].shape[1]
            if not (features["labels"] != IGNORE_INDEX).any():
                if self.on_empty == "error":
                    raise ValueError(
                        f"sample {index} has no label token once rendered with "
                        f"{self.model_name + ' encoding' if self.chat is None else self.chat.name} (empty or "
                        "whitespace-only answers, or a template that writes no assistant text); fix the sample or "
                        "pass on_empty='drop'"
                    )
                empty.append(index)
                continue
            if length > self.max_length:
                if self.on_overlong == "error":
                    raise ValueError(
                        f"sample {index} has {length} tokens (images expanded) > max_length={self.max_length}. "
                        "Raise max_length, shrink images (processor max_pixels), or pass on_overlong='drop'; "
                        "samples are never truncated (that would cut an image's tokens)."
                    )
                dropped.append(index)
                continue
            samples.append(features)
            images += media_parts(conversations[index], "image")
        if dropped:
            warnings.warn(
                f"dropped {len(dropped)} of {len(examples)} samples longer than max_length={self.max_length} "
                f"(indices {dropped})",
                stacklevel=3,
            )
        if empty:
            warnings.warn(f"dropped {len(empty)} of {len(examples)} samples without any label (indices {empty})",
                          stacklevel=3)
        if not samples:
            raise ValueError(
                f"no sample of the batch is left to train on ({len(dropped)} of {len(examples)} exceed max_length="
                f"{self.max_length}, {len(empty)} have no label). Raise max_length or filter the dataset."
            )
        return samples, sorted(dropped + empty), images

    def check_media(self, turns: list[dict], index: int) -> None:
        """Refuse a sample's videos / audio clips where the family's path is not proven (by name), and clips longer
        than the feature extractor takes (it would cut them silently)."""
        for kind, what in (("video", "a video"), ("audio", "an audio clip")):
            if media_parts(turns, kind):
                require_proven(self.family, kind, f"sample {index}: {what}", allow_unproven=self.allow_unproven)
        limit = getattr(getattr(self.processor, "feature_extractor", None), "n_samples", None)
        for turn, message in enumerate(turns):
            for part in message["content"]:
                if part["type"] == "audio" and limit is not None and len(part["audio"]) > limit:
                    raise ValueError(f"sample {index}, turn {turn}: audio clip of {len(part['audio'])} samples, longer "
                                     f"than the {limit} the feature extractor takes (it would cut the clip); split it")

    # ---------------------------------------------------------------- batching

    def _padded(self, samples: list[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
        """Right-pad the per-token keys to ``[B, width]``; adds the 0/1 ``attention_mask``."""
        lengths = torch.tensor([s["input_ids"].shape[1] for s in samples])
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        out = {"attention_mask": mask.long()}
        for key in self.token_keys:
            if key not in samples[0]:
                continue
            fill = _TOKEN_FILL.get(key, self.pad_token_id if key == "input_ids" else 0)
            flat = torch.cat([s[key].reshape(-1) for s in samples])
            padded = torch.full((len(samples), width), fill, dtype=flat.dtype)
            padded[mask] = flat
            out[key] = padded
        return out

    def _per_sample_keys(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        keys = dict.fromkeys(k for s in samples for k in s if k not in self.token_keys)
        vision = self.encoding.vision
        for key in (k for k in keys if k not in vision.rows):  # a per-token output the family does not declare
            if all(key not in s or s[key].shape == s["input_ids"].shape for s in samples) and len(samples) > 1:
                raise ValueError(
                    f"the processor returns {key!r} with one value per token, which {self.model_name} does not take "
                    f"(per-token keys: {list(self.token_keys)}): use the processor of the model you train"
                )
        indices = vision.patch_indices  # re-based where numbered per call
        return {key: patch_index.join([s.get(key) for s in samples], [s.get(indices[key]) for s in samples],
                                      self.patch_numbering)
                if key in indices
                else torch.cat([s[key] for s in samples if key in s], dim=-1 if key in vision.width_packed else 0)
                for key in keys}

    def _positions(self, samples: list[dict[str, torch.Tensor]], padded: dict[str, torch.Tensor],
                   vision: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[4, B, S]`` per-sample text + mRoPE positions for mRoPE models (0 at padding; without the text row
        where the family's ``mrope_text_row`` is False); None otherwise.

        One rope-index call on the padded batch, or one per sample where the family's ``rope_index_alone`` says its
        rope index counts media across a batch's rows (HunYuan-VL's image ordinal): each sample then gets the
        positions the stock model computes for it alone."""
        if self.rope_index is None:
            return None
        skip = 0 if self.encoding.positions.text_row else 1
        if not self.encoding.positions.alone:
            return self._rope_index(padded, vision)[skip:]
        width = padded["input_ids"].shape[1]
        rows = [self._rope_index({**sample, "attention_mask": torch.ones_like(sample["input_ids"])}, sample)[skip:, 0]
                for sample in samples]
        positions = rows[0].new_zeros(rows[0].shape[0], len(rows), width)
        for index, row in enumerate(rows):
            positions[:, index, : row.shape[1]] = row
        return positions

    def _rope_index(self, tokens: dict[str, torch.Tensor], vision: dict[str, torch.Tensor]) -> torch.Tensor:
        token_types = tokens.get("mm_token_type_ids")
        if token_types is None:  # a text tokenizer: no vision tokens anywhere (images were rejected earlier)
            token_types = torch.zeros_like(tokens["input_ids"])
        return self.rope_index(
            tokens["input_ids"],
            token_types,
            tokens["attention_mask"],
            image_grid_thw=vision.get("image_grid_thw"),
            video_grid_thw=vision.get("video_grid_thw"),
            second_per_grid_ts=vision.get("second_per_grid_ts"),
            target_sizes=vision.get("target_sizes"),
            audio_seqlens=_audio_lengths(vision),
        )

    def _pack(
        self, padded: dict[str, torch.Tensor], vision: dict[str, torch.Tensor], positions: torch.Tensor | None
    ) -> dict[str, Any]:
        """One packed row from the right-padded batch; per-sample tensors pass through in sample order."""
        packed = pack_batch_sequences(
            padded["input_ids"],
            labels=padded["labels"],
            position_ids=positions,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            padding_mask=padded["attention_mask"],
            pad_to_length=self.pad_to_length,
        )
        real = padded["attention_mask"].bool()
        others = {key: padded[key][real] for key in self.token_keys if key in padded and key not in _PACKED_KEYS}
        return self._packed_batch(packed, others, vision)

    def _pack_samples(self, samples: list[dict[str, torch.Tensor]], vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One packed row straight from the per-sample tensors (``pack_sequences``), no padded batch."""
        def field(key: str) -> list[torch.Tensor]:
            return [s[key].reshape(-1) for s in samples]

        packed = pack_sequences(
            field("input_ids"),
            labels=field("labels"),
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_to_length=self.pad_to_length,
        )
        others = {key: torch.cat(field(key)) for key in self.token_keys if key in samples[0] and key not in _PACKED_KEYS}
        return self._packed_batch(packed, others, vision)

    def _packed_batch(
        self, packed: PackedBatch, others: dict[str, torch.Tensor], vision: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The model-ready batch: packed fields, other per-token keys (``others``: real values in sample order)
        scattered into the real slots, per-sample tensors in sample order, bookkeeping under METADATA_KEY."""
        real_slots = ~packed.padding_mask
        labels = mask_first_labels(packed.labels, packed.cu_seqlens_padded[:-1])
        batch: dict[str, Any] = {"input_ids": packed.tokens, "labels": labels}
        for key, values in others.items():
            # Rows keep their order and fill slots are exactly padding_mask, so real values scatter back.
            row = torch.zeros_like(packed.tokens, dtype=values.dtype)
            row[real_slots] = values
            batch[key] = row
        batch["position_ids"] = packed.position_ids
        batch.update(packed.attention_kwargs())
        batch.update(vision)
        batch[METADATA_KEY] = {
            "cu_seqlens": packed.cu_seqlens,
            "cu_seqlens_padded": packed.cu_seqlens_padded,
            "seq_lengths": packed.seq_lengths,
        }
        return batch

    def _stats(
        self, batch: dict[str, Any], samples: list[dict], dropped: list[int], images: int, timings: dict[str, float]
    ) -> CollatorStats:
        real = sum(s["input_ids"].shape[1] for s in samples)
        if isinstance(self.image_token_id, int):  # every family's processor names its image placeholder token
            image_tokens = int((batch["input_ids"] == self.image_token_id).sum())
        else:
            token_types = batch.get("mm_token_type_ids")
            image_tokens = 0 if token_types is None else int((token_types == 1).sum())
        return CollatorStats(
            samples=len(samples),
            samples_dropped=len(dropped),
            real_tokens=real,
            label_tokens=int((batch["labels"] != IGNORE_INDEX).sum()),
            padded_slots=batch["input_ids"].numel() - real,
            images=images,
            image_tokens=image_tokens,
            **timings,
        )


def _check_video_runs(features: dict[str, torch.Tensor], processor: Any, runs: str, family: str, merge: int,
                      index: int) -> None:
    """A video sample's runs of video tokens must be laid out as the family's rope index reads them
    (``EncodingRules.video_runs``): one run per video, or one per temporal patch (Qwen3-VL: each after its timestamp).
    A processor of another family writes the other layout, and the frames' positions would be misplaced."""
    grid = features.get("video_grid_thw")
    video_id = getattr(processor, "video_token_id", None)
    if grid is None or not isinstance(video_id, int):
        return
    frame_tokens = (grid[:, 1] * grid[:, 2] // merge**2).tolist()
    frames = grid[:, 0].tolist()
    if runs == "frame":
        want = [tokens for tokens, count in zip(frame_tokens, frames) for _ in range(count)]
    else:
        want = [tokens * count for tokens, count in zip(frame_tokens, frames)]
    inside = torch.nn.functional.pad((features["input_ids"].reshape(-1) == video_id).long(), (1, 1))
    edges = inside.diff()
    got = ((edges == -1).nonzero().flatten() - (edges == 1).nonzero().flatten()).tolist()
    if got != want:
        layout = "one run per frame, each after its timestamp" if runs == "frame" else "one run per video"
        raise ValueError(
            f"sample {index}: its video tokens form runs of {got} tokens, but the {family} model's rope index "
            f"expects {layout} ({want}); encode with the model's own processor ({type(processor).__name__} "
            "writes another family's video layout)"
        )


def _audio_lengths(vision: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Mel frames of each audio clip (``feature_attention_mask`` row sums), which the Omni thinkers' rope index
    reads as ``audio_seqlens``; None without audio."""
    mask = vision.get("feature_attention_mask")
    return None if mask is None else mask.sum(-1)


def _image_token_id(processor: Any, encoding: EncodingRules) -> int | None:
    """The id each image expands into: the family's ``image_token`` where it names one (Ovis 2's ``<IMG_ATOM>``),
    else the processor's ``image_token_id`` (None for a text tokenizer)."""
    if encoding.vision.image_token is not None:
        return _token_id(processor, encoding.vision.image_token)
    token = getattr(processor, "image_token_id", None)
    return token if isinstance(token, int) else None


def _media_token_ids(processor: Any, encoding: EncodingRules) -> tuple[int, ...]:
    """Ids that never carry labels: the processor's image / video / audio placeholders and markers (Gemma's
    ``boi_token`` / ``eoi_token``) and the family's declared ``media_tokens``; tokens the vocabulary lacks are
    skipped."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = [getattr(owner, f"{kind}_token_id", None) for owner in (processor, tokenizer)
           for kind in ("image", "video", "audio")]
    tokens = [getattr(processor, name, None) for name in ("boi_token", "eoi_token")]
    tokens += list(encoding.media_tokens)
    unknown = getattr(tokenizer, "unk_token_id", None)
    vocab = tokenizer.get_vocab()
    ids += [vocab.get(token) for token in tokens if isinstance(token, str)]
    return tuple(sorted({i for i in ids if isinstance(i, int) and i != unknown}))


def _media_span_ids(processor: Any, encoding: EncodingRules) -> tuple[tuple[int, int], ...]:
    """The family's ``media_spans`` as id pairs (pairs the vocabulary lacks are skipped, like ``media_tokens``)."""
    if not encoding.media_spans:  # no second get_vocab() (150k entries) for families without spans
        return ()
    vocab = getattr(processor, "tokenizer", processor).get_vocab()
    pairs = ((vocab.get(open_), vocab.get(close)) for open_, close in encoding.media_spans)
    return tuple((o, c) for o, c in pairs if o is not None and c is not None)


def _token_id(processor: Any, token: str) -> int:
    """The id of ``token`` in the processor's vocabulary (the family's ``image_token``), or a clear error."""
    tokenizer = getattr(processor, "tokenizer", processor)
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"the family's image token {token!r} is not in the processor's vocabulary: processor and model "
                         "family do not match")
    return token_id


def _pad_id(tokenizer: Any) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id=... to the collator")
