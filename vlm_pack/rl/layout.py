"""TRL's padded rollout batch -> ONE packed row: every completion its own segment, or each group's prompt once.

TRL's GRPO / RLOO trainers hand their log-prob method a padded batch: ``input_ids = [prompt (left-padded) ;
completion (right-padded)]`` per rollout, an ``attention_mask`` over both, the vision tensors of every row (each
prompt's images repeated once per rollout of its group) and ``logits_to_keep`` (the completion width).
:class:`RolloutPacker` drops the padding and lays the rollouts out in one row:

* packed: ``prompt + completion`` per rollout, each an attention segment with its own positions (0..L-1, or the
  family's mRoPE from the model's own ``get_rope_index``), vision tensors in row order;
* shared prompts (``group_size`` set): per group of ``group_size`` consecutive rollouts, the prompt ONCE (its
  images once), then each completion as a segment that sees the prompt and itself (``vlm_pack.attention.
  shared_prefix`` keys), its positions those the model gives ``prompt + completion`` alone.

Every completion token is scored at the row slot holding the token before it in ITS sequence (``predictors``):
the prompt's last slot predicts the first token of all ``group_size`` completions, so the backbone's hidden
states are gathered at ``predictors`` before the LM head (no shifted row can say it).
Bad input fails at the first batch with the fix: rows of one group with different prompts or images, a completion
longer than ``max_completion_length``, per-token vision ids that disagree with the image tokens (a processor
padding prompts on the right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

from ..attention.shared_prefix import SHARED_PREFIX_KWARG, shared_prefix_keys
from ..core.packing import pack_sequences
from ..core.rope_index import MRopeIndex
from ..models import FamilySpec

__all__ = ["PackedRollouts", "RolloutPacker", "VISION_KEYS"]

VISION_KEYS = ("pixel_values", "image_grid_thw", "image_sizes", "mm_token_type_ids", "num_tiles",
               "pixel_attention_mask")
"""TRL forward kwargs the packer handles; any other non-None one (tiles, pixel masks, token types) is refused."""


@dataclass
class PackedRollouts:
    """One packed forward: ``inputs`` (model kwargs), and for each of the N scored tokens its predicting row slot,
    its id (``targets`` ``[1, N]``, TRL's ``shift_labels``) and where it goes in TRL's ``[B, C]`` output."""

    inputs: dict[str, Any]
    predictors: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor


@dataclass
class _Rollout:
    prompt: torch.Tensor  # [Lp] ids
    completion: torch.Tensor  # [c] ids (empty when TRL masked the whole completion)
    mm: torch.Tensor | None  # [Lp] per-token vision ids of the prompt
    pixels: list[torch.Tensor]  # per image (per tile for tile-indexed pixel_values, e.g. InternVL)
    grids: list[torch.Tensor]  # per image ([3]) or empty
    sizes: list[torch.Tensor]  # per image ([2]) or empty
    pixel_masks: list[torch.Tensor]  # per tile of a per-rollout tile stack (Idefics3's pixel_attention_mask) or empty


class RolloutPacker:
    """Callable: TRL's padded rollout tensors -> :class:`PackedRollouts` (see the module docstring).

    ``family``: the model's registry entry (positions rule, per-token keys). ``model_config``: ``model.config``.
    ``group_size``: rollouts per prompt when prompts are shared (None: packed, each rollout its own prompt).
    ``media_token_ids``: image / video placeholder ids (the right-padding check).
    """

    def __init__(self, family: FamilySpec, model_config: PreTrainedConfig, *, group_size: int | None,
                 max_completion_length: int | None, media_token_ids: tuple[int, ...] = ()) -> None:
        self.family = family
        self.group_size = group_size
        self.max_completion_length = max_completion_length
        self.media_token_ids = media_token_ids
        self.rope_index = (MRopeIndex(model_config, family.encoding.positions.rope_index_model)
                           if family.encoding.positions.rule == "mrope" else None)

    # ---------------------------------------------------------------- unpadding

    def _rollouts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  vision: dict[str, Any], num_images: list[int] | None) -> list[_Rollout]:
        unknown = sorted(k for k, v in vision.items() if v is not None and k not in VISION_KEYS)
        if unknown:
            raise ValueError(f"packed rollouts got vision inputs {unknown}: only {list(VISION_KEYS)} are proven; use "
                             "TRL's own trainer for this model family")
        rows, width = input_ids.shape
        split = width - logits_to_keep
        pixels, grids, sizes = vision.get("pixel_values"), vision.get("image_grid_thw"), vision.get("image_sizes")
        if pixels is not None and num_images is None:
            raise ValueError("pixel_values without num_images: the images cannot be assigned to their rollouts")
        counts = list(num_images) if num_images is not None else [0] * rows
        per_image_pixels: list[torch.Tensor] = []
        tiles = vision.get("num_tiles")  # TRL's tile count per rollout (InternVL's tile-indexed pixel_values)
        stacks = vision.get("pixel_attention_mask")  # one padded tile stack per rollout (Idefics3 / SmolVLM)
        if pixels is not None and stacks is not None:
            if pixels.ndim != 5 or pixels.shape[0] != rows or stacks.shape[:2] != pixels.shape[:2]:
                raise ValueError(f"pixel_values {tuple(pixels.shape)} / pixel_attention_mask {tuple(stacks.shape)} "
                                 f"are not one tile stack per rollout ({rows} rollouts)")
        elif pixels is not None and tiles is not None:
            if pixels.shape[0] != sum(tiles) or len(tiles) != rows:
                raise ValueError(f"pixel_values has {pixels.shape[0]} tiles but num_tiles {list(tiles)} counts "
                                 f"{sum(tiles)} over {len(tiles)} rollouts (of {rows})")
            per_image_pixels = list(pixels)
            counts = list(tiles)  # a rollout's tiles stand in for its images below
        elif pixels is not None:
            if grids is not None:
                per_image_pixels = list(torch.split(pixels, grids.prod(-1).tolist()))
            elif pixels.shape[0] == sum(counts):
                per_image_pixels = list(pixels)
            else:
                raise ValueError(f"pixel_values has {pixels.shape[0]} rows for {sum(counts)} images and no "
                                 "image_grid_thw: this layout (tiles / per-sample crops) is not proven for packed "
                                 "rollouts")
        out, image = [], 0
        for b in range(rows):
            prompt_mask = attention_mask[b, :split].bool()
            length = int(prompt_mask.sum())
            if not bool(prompt_mask[split - length:].all()):
                raise ValueError(f"rollout {b}: the prompt is not left-padded (TRL pads prompts on the left)")
            completion_mask = attention_mask[b, split:].bool()
            size = int(completion_mask.sum())
            if not bool(completion_mask[:size].all()):
                raise ValueError(f"rollout {b}: the completion mask has holes; completions must be right-padded")
            if self.max_completion_length is not None and size > self.max_completion_length:
                raise ValueError(
                    f"rollout {b}: completion of {size} tokens > max_completion_length={self.max_completion_length}; "
                    "cut completions to max_completion_length in the rollout function (or raise it)")
            prompt = input_ids[b, split - length:split]
            mm = vision.get("mm_token_type_ids")
            mm = None if mm is None else mm[b, split - length:split]
            if mm is not None and self.media_token_ids:
                is_media = torch.isin(prompt, torch.tensor(self.media_token_ids, device=prompt.device))
                if not torch.equal(mm != 0, is_media):
                    raise ValueError(
                        f"rollout {b}: mm_token_type_ids do not mark the prompt's image tokens: the processor pads "
                        "prompts on the right while TRL left-pads them, which shifts the vision ids (and mRoPE). Set "
                        "processing_class.tokenizer.padding_side = 'left' (or padding_side='left' when loading it)")
            n = counts[b]
            out.append(_Rollout(
                prompt=prompt, completion=input_ids[b, split:split + size], mm=mm,
                pixels=list(pixels[b]) if stacks is not None else per_image_pixels[image:image + n],
                grids=[] if grids is None else list(grids[image:image + n]),
                sizes=[] if sizes is None else list(sizes[image:image + n]),
                pixel_masks=[] if stacks is None else list(stacks[b]),
            ))
            image += n
        return out

    def _check_group(self, group: list[_Rollout], first_row: int) -> None:
        head = group[0]
        for offset, other in enumerate(group[1:], 1):
            same = (torch.equal(other.prompt, head.prompt) and len(other.pixels) == len(head.pixels)
                    and all(torch.equal(a, b) for a, b in zip(other.pixels, head.pixels))
                    and all(torch.equal(a, b) for a, b in zip(other.grids, head.grids)))
            if not same:
                raise ValueError(
                    f"rollouts {first_row} and {first_row + offset} belong to one group of {len(group)} but their "
                    "prompts (or images) differ, so they cannot share one prompt: a rollout function or environment "
                    "that changes the prompt per rollout needs share_prompts=False")

    # ---------------------------------------------------------------- positions

    def _positions(self, rollouts: list[_Rollout]) -> list[torch.Tensor]:
        """Per rollout, positions of ``prompt + completion`` alone: ``[L]`` or ``[4, L]`` (text row + mRoPE)."""
        lengths = [r.prompt.numel() + r.completion.numel() for r in rollouts]
        if self.rope_index is None:
            return [torch.arange(n, device=rollouts[0].prompt.device) for n in lengths]
        device = rollouts[0].prompt.device
        width = max(lengths)
        ids = torch.zeros(len(rollouts), width, dtype=torch.long, device=device)
        mm = torch.zeros_like(ids)
        mask = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        for i, r in enumerate(rollouts):
            ids[i, :lengths[i]] = torch.cat([r.prompt, r.completion])
            if r.mm is not None:
                mm[i, :r.prompt.numel()] = r.mm
        grids = [g for r in rollouts for g in r.grids]
        kwargs = {"image_grid_thw": torch.stack(grids)} if grids else {}
        rows = self.rope_index(ids, mm, mask.long(), **kwargs)
        return [rows[:, i, :n] for i, n in enumerate(lengths)]

    # ---------------------------------------------------------------- packing

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 num_images: list[int] | None = None, **vision: Any) -> PackedRollouts:
        rollouts = self._rollouts(input_ids, attention_mask, logits_to_keep, vision, num_images)
        positions = self._positions(rollouts)
        device = input_ids.device
        tokens, pos, mm, prefixes, images = [], [], [], [], []
        predictors, targets, rows, columns = [], [], [], []
        start = 0

        def segment(ids: torch.Tensor, p: torch.Tensor, m: torch.Tensor | None, prefix=(0, 0)) -> int:
            nonlocal start
            tokens.append(ids)
            pos.append(p)
            mm.append(torch.zeros_like(ids) if m is None else m)
            prefixes.append(prefix)
            first = start
            start += ids.numel()
            return first

        def score(row: int, first_predictor: int, completion_start: int, size: int) -> None:
            slots = torch.arange(completion_start - 1, completion_start + size - 1, device=device)
            slots[0] = first_predictor
            predictors.append(slots)
            targets.append(rollouts[row].completion)
            rows.append(torch.full((size,), row, device=device))
            columns.append(torch.arange(size, device=device))

        group = self.group_size or 1
        if len(rollouts) % group:
            raise ValueError(f"{len(rollouts)} rollouts do not form whole groups of {group}: shared prompts need each "
                             "group's rollouts in one micro-batch (per_device_train_batch_size a multiple of "
                             "num_generations)")
        for g in range(0, len(rollouts), group):
            members = range(g, g + group)
            scored = [b for b in members if rollouts[b].completion.numel()]
            if self.group_size is None:
                for b in scored:
                    r = rollouts[b]
                    lp = r.prompt.numel()
                    first = segment(torch.cat([r.prompt, r.completion]), positions[b],
                                    None if r.mm is None else torch.cat([r.mm, torch.zeros_like(r.completion)]))
                    images.append(r)
                    score(b, first + lp - 1, first + lp, r.completion.numel())
                continue
            self._check_group([rollouts[b] for b in members], g)
            if not scored:
                continue
            head = rollouts[scored[0]]
            lp = head.prompt.numel()
            prompt_start = segment(head.prompt, positions[scored[0]][..., :lp], head.mm)
            images.append(head)
            for b in scored:
                r = rollouts[b]
                first = segment(r.completion, positions[b][..., lp:], None, prefix=(prompt_start, lp))
                score(b, prompt_start + lp - 1, first, r.completion.numel())
        if not tokens:
            return PackedRollouts({}, *(torch.zeros(0, dtype=torch.long, device=device) for _ in range(4)))
        packed = pack_sequences(tokens, position_ids=pos)
        inputs: dict[str, Any] = {"input_ids": packed.tokens.to(device), "position_ids": packed.position_ids.to(device)}
        inputs.update({k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.attention_kwargs().items()})
        if "mm_token_type_ids" in vision and vision["mm_token_type_ids"] is not None:
            inputs["mm_token_type_ids"] = torch.cat(mm).unsqueeze(0)
        pixels = [p for r in images for p in r.pixels]
        masks = [m for r in images for m in r.pixel_masks]
        if masks:  # the row's tile stacks as one (the model drops the all-zero padding tiles)
            inputs["pixel_values"] = torch.stack(pixels).unsqueeze(0)
            inputs["pixel_attention_mask"] = torch.stack(masks).unsqueeze(0)
        elif pixels:
            grids = [g for r in images for g in r.grids]
            inputs["pixel_values"] = torch.cat(pixels) if grids else torch.stack(pixels)
            if grids:
                inputs["image_grid_thw"] = torch.stack(grids)
            sizes = [s for r in images for s in r.sizes]
            if sizes:
                inputs["image_sizes"] = torch.stack(sizes)
        if self.group_size is not None:
            inputs[SHARED_PREFIX_KWARG] = shared_prefix_keys([t.numel() for t in tokens], prefixes)
        return PackedRollouts(inputs, torch.cat(predictors), torch.cat(targets).unsqueeze(0), torch.cat(rows),
                              torch.cat(columns))
