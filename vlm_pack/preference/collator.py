"""``PreferenceCollator``: TRL preference examples -> ONE packed row holding every chosen and rejected sequence.

Input: TRL's two preference formats. Text datasets arrive tokenised by ``DPOTrainer`` (``prompt_ids`` /
``chosen_ids`` / ``rejected_ids``; reward data: ``vlm_pack.preference.reward.RewardCollator``); vision datasets
arrive raw (``prompt`` / ``chosen`` / ``rejected`` and ``images`` or ``image``) and are rendered exactly as TRL's
``DataCollatorForVisionPreference`` does (TRL's ``apply_chat_template``, the processor on the prompt with its
images, the completions tokenised alone), so the token ids equal TRL's.

Row layout, pair by pair: ``prompt + chosen`` then ``prompt + rejected`` (each sequence its own attention segment,
positions per sequence: 0..L-1, or mRoPE from the model's own ``get_rope_index``), vision tensors in row order.
With ``shared_prompts=True`` a pair is ``prompt + chosen`` then ``prompt[-1] + rejected``: the prompt (its images
and vision encoding) is computed once, the rejected segment sees the prompt through the
``vlm_pack.attention.shared_prefix`` rule and its positions continue from the prompt end.

Every completion token ``t`` is scored at the row slot holding the token before it in ITS sequence:
``batch["vlm_pack"]["preference"]`` carries ``shift_labels`` (``[1, T]``: the target id scored at each slot, -100
elsewhere; TRL's fused LM head takes it as is) and ``sequence_of_target`` (``[T]``: which sequence, ``2 i`` chosen
/ ``2 i + 1`` rejected of pair ``i``, each slot's target belongs to; -1 elsewhere), the completion lengths, and
precomputed reference log-probs when the examples carry them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers.configuration_utils import PreTrainedConfig

from ..core.batch import METADATA_KEY
from ..models import FamilySpec, get_family, require_proven
from ..core.packing import IGNORE_INDEX, pack_sequences
from ..attention.shared_prefix import SHARED_PREFIX_KWARG, shared_prefix_keys
from ..core.rope_index import MRopeIndex

__all__ = ["OVERLONG", "PREFERENCE_KEY", "ROW_KEY", "TRUNCATION_MODES", "PreferenceCollator"]

PREFERENCE_KEY = "preference"
"""Entry of ``batch["vlm_pack"]`` holding the pair layout (see the module docstring)."""

_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
ROW_KEY = "vlm_pack_row"
"""Example field holding its dataset row (``PackedDPOTrainer`` adds it), so errors name the row, not the slot."""
TRUNCATION_MODES = ("keep_start", "keep_end")
OVERLONG = ("truncate", "drop")


@dataclass
class _Pair:
    """One encoded pair: the prompt's per-token tensors ``[Lp]``, its vision tensors, the two completions."""

    prompt: dict[str, torch.Tensor]
    vision: dict[str, torch.Tensor]
    chosen: torch.Tensor
    rejected: torch.Tensor
    cuts: tuple[int, int] = (0, 0)  # prompt tokens cut off the start of the chosen / rejected sequence (keep_end)


class PreferenceCollator:
    """Picklable ``collate_fn`` for ``PackedDPOTrainer``: preference pairs -> one packed row.

    ``processor``: the tokenizer (text) or the multimodal processor (vision) given to the TRL trainer.
    ``model_config``: ``model.config``; its family (``vlm_pack.models``) fixes positions and per-token keys.
    Required for vision data; optional for text (positions then restart at 0 per sequence).
    ``shared_prompts``: pack each pair's prompt once (module docstring); not with image-block families (Gemma 3).
    ``max_length``: longest sequence (prompt + completion). A longer one is truncated as TRL's ``DPOTrainer``
    does (``overlong="truncate"``, the default), each sequence on its own: ``truncation_mode="keep_start"`` keeps
    its first ``max_length`` tokens (the completion's end is cut), ``"keep_end"`` its last ones (the prompt's
    start is cut; text only, not with ``shared_prompts``). A pair that cannot be truncated so (its prompt alone
    fills ``max_length`` with keep_start, which TRL drops when it tokenises text; a completion alone filling it
    with keep_end; an image that would be cut) raises, naming the dataset row (``ROW_KEY``) when the example
    carries it. ``overlong="drop"``: ``PackedDPOTrainer`` drops longer pairs from the dataset (counted) and the
    collator raises on any it still gets. :meth:`overlong_problem` is the rule.
    """

    def __init__(
        self,
        processor: Any,
        *,
        model_config: PreTrainedConfig | None = None,
        shared_prompts: bool = False,
        max_length: int | None = None,
        truncation_mode: str = "keep_start",
        overlong: str = "truncate",
        pad_token_id: int | None = None,
        allow_unproven: bool = False,
    ) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.has_images = hasattr(processor, "image_processor")
        self.family: FamilySpec | None = (
            None if model_config is None else get_family(model_config, allow_unproven=allow_unproven)
        )
        if self.family is None and self.has_images:
            raise ValueError("a multimodal processor needs model_config=model.config (positions and per-token keys "
                             "follow the model's family)")
        self.allow_unproven = allow_unproven
        if self.family is not None:
            require_proven(self.family, "dpo_shared_prompt" if shared_prompts else "dpo",
                           f"PreferenceCollator(shared_prompts={shared_prompts})", allow_unproven=allow_unproven)
        self.shared_prompts = shared_prompts
        self.max_length = max_length
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode={truncation_mode!r}; choose one of {', '.join(TRUNCATION_MODES)}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong={overlong!r}; choose 'truncate' (like TRL) or 'drop' (dropped and counted)")
        self.truncation_mode, self.overlong = truncation_mode, overlong
        self.check_truncation()
        pad = self.tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.token_keys = ("input_ids",) if self.family is None else tuple(
            key for key in self.family.encoding.token_keys if key != "labels")
        self.rope_index = (
            MRopeIndex(model_config, self.family.encoding.positions.rope_index_model)
            if self.family is not None and self.family.encoding.positions.rule == "mrope" else None
        )
        image_token = getattr(processor, "image_token_id", None)
        self.media_tokens = {t for t in (image_token, getattr(processor, "video_token_id", None)) if isinstance(t, int)}

    # ---------------------------------------------------------------- encoding (TRL's tokenisation)

    def check_truncation(self) -> None:
        """Refuse truncation settings this collator cannot apply exactly (raised when built or configured)."""
        if self.max_length is None or self.overlong != "truncate" or self.truncation_mode != "keep_end":
            return
        if self.shared_prompts:
            raise ValueError("truncation_mode='keep_end' cuts each sequence's prompt differently, so a pair's prompt "
                             "cannot be shared: use shared_prompts=False, truncation_mode='keep_start' or "
                             "overlong='drop'")
        if self.has_images:
            raise ValueError("truncation_mode='keep_end' would cut image tokens out of the prompt (TRL refuses it "
                             "for vision data too): use truncation_mode='keep_start' or overlong='drop'")

    def sequence_lengths(self, example: Mapping[str, Any]) -> tuple[int, int, int]:
        """Untruncated token counts ``(prompt, chosen, rejected)`` of one example (encodes a raw vision example)."""
        if "prompt_ids" in example:
            return tuple(len(example[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
        pair = self._encode_raw(example)
        return pair.prompt["input_ids"].numel(), pair.chosen.numel(), pair.rejected.numel()

    def overlong_problem(self, prompt: int, chosen: int, rejected: int) -> str | None:
        """Why a pair of these lengths cannot go into a batch as is or truncated (None: it can)."""
        limit = self.max_length
        if limit is None or prompt + max(chosen, rejected) <= limit:
            return None
        if self.overlong == "drop":
            return f"prompt + completion has {prompt + max(chosen, rejected)} tokens > max_length={limit}"
        if self.truncation_mode == "keep_start" and prompt >= limit:
            return (f"its prompt alone has {prompt} tokens >= max_length={limit}, so keep_start truncation would "
                    "leave no completion token (TRL drops such pairs when it tokenises text)")
        if self.truncation_mode == "keep_end" and max(chosen, rejected) >= limit:
            return (f"a completion alone has {max(chosen, rejected)} tokens >= max_length={limit}, so keep_end "
                    "truncation would cut the whole prompt")
        return None

    def _fit(self, pair: _Pair, where: str) -> _Pair:
        """``pair`` truncated to ``max_length`` per sequence (class doc), or a ValueError naming ``where``."""
        prompt = pair.prompt["input_ids"].numel()
        problem = self.overlong_problem(prompt, pair.chosen.numel(), pair.rejected.numel())
        if problem is not None:
            fix = ("raise max_length or set overlong='drop' (PackedDPOTrainer drops such pairs and counts them)"
                   if self.overlong == "truncate" else "PackedDPOTrainer drops such pairs before training; raise "
                   "max_length or filter the dataset")
            raise ValueError(f"{where}: {problem}; {fix}")
        if self.max_length is None:
            return pair
        room = self.max_length - prompt
        if self.truncation_mode == "keep_start":
            return replace(pair, chosen=pair.chosen[:room], rejected=pair.rejected[:room])
        cuts = tuple(max(0, c.numel() - room) for c in (pair.chosen, pair.rejected))
        return replace(pair, cuts=cuts)

    def _encode(self, example: Mapping[str, Any], index: int) -> _Pair:
        where = (f"dataset row {example[ROW_KEY]}" if ROW_KEY in example
                 else f"example {index} of the micro-batch")
        if "prompt_ids" in example:  # tokenised by DPOTrainer._prepare_dataset
            prompt = {"input_ids": torch.as_tensor(example["prompt_ids"], dtype=torch.long)}
            chosen, rejected = (torch.as_tensor(example[k], dtype=torch.long) for k in ("chosen_ids", "rejected_ids"))
            pair = _Pair(prompt, {}, chosen, rejected)
        elif "prompt" in example:
            pair = self._encode_raw(example)
        else:
            raise ValueError(
                f"{where}: expected TRL preference fields (prompt_ids/chosen_ids/rejected_ids, or prompt/"
                f"chosen/rejected with images); got keys {sorted(example)}"
            )
        length = pair.prompt["input_ids"].numel()
        if length == 0:
            raise ValueError(f"{where}: empty prompt; the first completion token would have no context")
        for name, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            if completion.numel() == 0:
                raise ValueError(f"{where}: empty {name} completion (no token to score)")
        pair = self._fit(pair, where)
        if self.shared_prompts and int(pair.prompt["input_ids"][-1]) in self.media_tokens:
            raise ValueError(f"{where}: the prompt ends on an image token, which shared_prompts cannot restate")
        return pair

    def _encode_raw(self, example: Mapping[str, Any]) -> _Pair:
        """Render and tokenise like TRL's ``DataCollatorForVisionPreference`` (same ids, same vision tensors)."""
        from trl.data_utils import apply_chat_template, is_conversational, prepare_multimodal_messages

        example = {key: value for key, value in example.items() if key != ROW_KEY}
        images = [example.pop("image")] if "image" in example else list(example.get("images") or [])
        if is_conversational(example):
            example["prompt"] = prepare_multimodal_messages(example["prompt"], images=images)
            for key in ("chosen", "rejected"):
                example[key] = prepare_multimodal_messages(example[key])
            example = apply_chat_template(example, self.processor)
        prompt = self.processor(images=[images] if images else None, text=[example["prompt"]],
                                return_tensors="pt", add_special_tokens=False)
        completions = [
            self.processor(text=[example[key]], return_tensors="pt", add_special_tokens=False)["input_ids"][0]
            for key in ("chosen", "rejected")
        ]
        tokens = {key: prompt[key][0] for key in self.token_keys if key in prompt}
        vision = {key: value for key, value in prompt.items()
                  if key not in self.token_keys and key != "attention_mask" and isinstance(value, torch.Tensor)}
        return _Pair(tokens, vision, *completions)

    # ---------------------------------------------------------------- packing

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise ValueError("empty batch: the collator got no preference pairs")
        pairs = [self._encode(example, i) for i, example in enumerate(examples)]
        sequences = [self._sequence(pair, completion, cut) for pair in pairs
                     for completion, cut in zip((pair.chosen, pair.rejected), pair.cuts)]
        vision_per_sequence = [pair.vision for pair in pairs for _ in range(2)]
        positions = self._positions(sequences, vision_per_sequence)
        # prompt tokens of every sequence (keep_end truncation cuts each sequence's prompt on its own)
        prompt_lengths = [pair.prompt["input_ids"].numel() - cut for pair in pairs for cut in pair.cuts]
        # Row segments: the full sequences, or (shared prompts) the rejected one from the prompt's last token on.
        skip = [0 if s % 2 == 0 or not self.shared_prompts else prompt_lengths[s] - 1
                for s in range(len(sequences))]
        segments = [{key: value[..., cut:] for key, value in seq.items()} for seq, cut in zip(sequences, skip)]
        packed = pack_sequences(
            [seg["input_ids"] for seg in segments],
            position_ids=None if positions is None else [p[..., cut:] for p, cut in zip(positions, skip)],
            pad_token_id=self.pad_token_id,
        )
        batch: dict[str, Any] = {"input_ids": packed.tokens}
        for key in self.token_keys:
            if key != "input_ids" and key in segments[0]:
                batch[key] = torch.cat([seg[key] for seg in segments]).unsqueeze(0)
        batch["position_ids"] = packed.position_ids
        batch.update(packed.attention_kwargs())
        visions = vision_per_sequence[::2] if self.shared_prompts else vision_per_sequence
        for key in dict.fromkeys(k for v in visions for k in v):
            batch[key] = torch.cat([v[key] for v in visions if key in v])
        lengths = [seg["input_ids"].numel() for seg in segments]
        if self.shared_prompts:
            starts = np.concatenate([[0], np.cumsum(lengths)])
            prefixes = [(0, 0) if s % 2 == 0 else (int(starts[s - 1]), prompt_lengths[s] - 1)
                        for s in range(len(segments))]
            batch[SHARED_PREFIX_KWARG] = shared_prefix_keys(lengths, prefixes)
        batch[METADATA_KEY] = {
            "cu_seqlens": packed.cu_seqlens,
            "cu_seqlens_padded": packed.cu_seqlens_padded,
            "seq_lengths": packed.seq_lengths,
            PREFERENCE_KEY: self._targets(packed.tokens, lengths, prompt_lengths, skip, examples),
        }
        return batch

    def _sequence(self, pair: _Pair, completion: torch.Tensor, cut: int = 0) -> dict[str, torch.Tensor]:
        """prompt (less its first ``cut`` tokens) + completion, per-token keys included (0 over the completion, as
        TRL fills them)."""
        out = {"input_ids": torch.cat([pair.prompt["input_ids"][cut:], completion])}
        for key, value in pair.prompt.items():
            if key != "input_ids":
                out[key] = torch.cat([value[cut:], value.new_zeros(completion.numel())])
        return out

    def _positions(self, sequences: list[dict[str, torch.Tensor]],
                   visions: list[dict[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """Per-sequence ``[4, L]`` text + mRoPE positions, or ``[L]`` (0..L-1) with shared prompts (the rejected
        segment continues from the prompt end); None: every segment restarts at 0."""
        if self.rope_index is None:
            return [torch.arange(seq["input_ids"].numel()) for seq in sequences] if self.shared_prompts else None
        lengths = [seq["input_ids"].numel() for seq in sequences]
        width = max(lengths)
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)

        def padded(key: str) -> torch.Tensor:
            out = torch.zeros(len(sequences), width, dtype=torch.long)
            if key in sequences[0]:
                out[mask] = torch.cat([seq[key] for seq in sequences])
            return out

        grids = {key: torch.cat([v[key] for v in visions if key in v]) for key in ("image_grid_thw", "video_grid_thw")
                 if any(key in v for v in visions)}
        rows = self.rope_index(padded("input_ids"), padded("mm_token_type_ids"), mask.long(), **grids)
        return [rows[:, s, :length] for s, length in enumerate(lengths)]

    def _targets(self, tokens: torch.Tensor, lengths: list[int], prompt_lengths: list[int], skip: list[int],
                 examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Where each completion token is scored: the slot before it in its own sequence (module docstring)."""
        total = tokens.shape[-1]
        sequence_of_target = np.full(total, -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        completion_lengths = []
        for s, (start, length) in enumerate(zip(starts[:-1], lengths)):
            prompt_in_row = prompt_lengths[s] - skip[s]  # prompt tokens of sequence s inside its segment
            completion_lengths.append(length - prompt_in_row)
            sequence_of_target[start + prompt_in_row - 1:start + length - 1] = s
        scored = torch.from_numpy(sequence_of_target)
        shift_labels = torch.full_like(tokens, IGNORE_INDEX)
        sources = torch.nonzero(scored >= 0).flatten()
        shift_labels[0, sources] = tokens[0, sources + 1]
        out: dict[str, Any] = {
            "shift_labels": shift_labels,
            "sequence_of_target": scored,
            "completion_lengths": torch.tensor(completion_lengths),
            "pairs": len(prompt_lengths) // 2,
        }
        for key in _REF_KEYS:
            if key in examples[0]:
                out[key] = torch.tensor([float(example[key]) for example in examples])
        return out
