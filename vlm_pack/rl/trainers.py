"""``PackedGRPOTrainer`` / ``PackedRLOOTrainer``: TRL's GRPO and RLOO trainers on packed rollouts, one hook each.

TRL 1.16 computes every log-prob of its GRPO and RLOO steps (policy in ``_compute_loss``, old policy and reference
in ``_generate_and_score_completions``) in ONE method, ``_get_per_token_logps_and_entropies``, from a padded
``[prompt; completion]`` batch. The subclasses override that method only: the rollouts go through one packed row
per chunk (:class:`~vlm_pack.rl.layout.RolloutPacker`; each group's prompt and images once with
``share_prompts=True``), the backbone's hidden states are gathered at the predicting slots and TRL's own fused LM
head (temperature, fp32 head, entropies) scores them; the ``[B, C]`` log-probs / entropies go back in TRL's layout
(0 where TRL's are masked). Generation, rewards, advantages, normalisation, clipping, KL and metrics stay TRL's.

With shared prompts a group's rollouts must reach one forward together: TRL shuffles the generation batch row by
row before splitting it into micro-batches, so while ``_prepare_inputs`` runs the shuffle is replaced by one that
moves whole groups (:func:`shuffle_groups`), and ``per_device_*_batch_size`` must be a multiple of the group size.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer, RLOOTrainer

from ..integrations.fused_tiles import FusedTiles, fused_tiles
from ..integrations.hf_model import enable_packing
from ..models import get_family, require_proven
from .layout import PackedRollouts, RolloutPacker

__all__ = ["PackedGRPOTrainer", "PackedRLOOTrainer", "gather_hidden_states", "shuffle_groups"]


def shuffle_groups(seq_dict: dict[str, Any], group_size: int) -> dict[str, Any]:
    """TRL's ``shuffle_sequence_dict`` with whole groups of ``group_size`` consecutive rows moved together."""
    rows = len(next(v for v in seq_dict.values() if v is not None))
    order = (torch.randperm(rows // group_size).unsqueeze(1) * group_size + torch.arange(group_size)).flatten()

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        return value[order] if isinstance(value, torch.Tensor) else [value[i] for i in order]

    return {key: permute(value) for key, value in seq_dict.items()}


@contextlib.contextmanager
def gather_hidden_states(backbone: torch.nn.Module, index: torch.Tensor):
    """While active, ``backbone``'s ``last_hidden_state`` ``[1, T, D]`` is cut to the row slots ``index``."""

    def hook(module, args, output):
        output["last_hidden_state"] = output.last_hidden_state.index_select(1, index)
        return output

    handle = backbone.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _replaced(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _hf_model(model) -> torch.nn.Module:
    return model.get_base_model() if is_peft_model(model) else model


class _PackedRollouts(FusedTiles):
    """The packed log-prob hook and the group-keeping shuffle, shared by the GRPO and RLOO subclasses; TRL's fused
    head in smaller tiles (:mod:`vlm_pack.integrations.fused_tiles`) for the loss and the rollouts' log-probs."""

    _trl_base: type

    def _setup_packing(self, share_prompts: bool, allow_unproven: bool) -> None:
        model = _hf_model(self.accelerator.unwrap_model(self.model))
        family = get_family(model.config, allow_unproven=allow_unproven)
        name = type(self).__name__
        require_proven(family, "rl_shared_prompt" if share_prompts else "rl",
                       f"{name}(share_prompts={share_prompts})", allow_unproven=allow_unproven)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(f"{name}: the MoE router auxiliary loss is not supported on packed rollouts")
        if getattr(self, "tools", None) or getattr(self, "environment_factories", None) is not None:
            raise ValueError(f"{name}: tools and environments (multi-turn rollouts, tool images) are not proven on "
                             "packed rollouts; use TRL's trainer")
        if share_prompts:
            for split, size, group in (("train", self.args.per_device_train_batch_size, self.num_generations),
                                       ("eval", self.args.per_device_eval_batch_size, self.num_generations_eval)):
                if size % group:
                    raise ValueError(
                        f"{name}: share_prompts=True needs per_device_{split}_batch_size ({size}) to be a multiple of "
                        f"the group size ({group}) so each group's rollouts share one forward; change either, or "
                        "pass share_prompts=False")
        processor = self.processing_class
        media = tuple(t for t in (getattr(processor, key, None) for key in ("image_token_id", "video_token_id"))
                      if isinstance(t, int))
        self.share_prompts = share_prompts
        self._packers = {
            mode: RolloutPacker(family, model.config, group_size=group if share_prompts else None,
                                max_completion_length=self.max_completion_length, media_token_ids=media)
            for mode, group in (("train", self.num_generations), ("eval", self.num_generations_eval))
        }
        for candidate in (self.model, self.ref_model):
            if candidate is not None:
                enable_packing(_hf_model(self.accelerator.unwrap_model(candidate)), allow_unproven=allow_unproven)

    def _prepare_inputs(self, generation_batch):
        if not self.share_prompts:
            with fused_tiles():
                return super()._prepare_inputs(generation_batch)
        module = sys.modules[self._trl_base.__module__]
        keep = lambda batch: shuffle_groups(batch, self.num_generations)  # noqa: E731
        with _replaced(module, "shuffle_sequence_dict", keep), fused_tiles():
            return super()._prepare_inputs(generation_batch)

    def _packed_chunk(self, model, packed: PackedRollouts, shape: tuple[int, int], compute_entropy: bool):
        """One packed forward -> ``[B, C]`` log-probs and entropies (None unless asked) in TRL's layout."""
        hf_model = _hf_model(self.accelerator.unwrap_model(model))
        if packed.predictors.numel() == 0:  # every completion masked: a zero still connected to the model
            weight = hf_model.get_output_embeddings().weight
            zeros = torch.zeros(shape, device=weight.device) + 0.0 * weight[:1, :1].sum()
            return zeros, zeros.detach().clone() if compute_entropy else None
        backbone = hf_model.base_model
        with gather_hidden_states(backbone, packed.predictors), self.accelerator.autocast():
            outputs = model(**packed.inputs, shift_labels=packed.targets, fused_lm_head=True)

        def scatter(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(shape).index_put((packed.rows, packed.columns), values.reshape(-1))

        return scatter(outputs.log_probs), scatter(outputs.entropy) if compute_entropy else None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, num_images=None, **vision):
        """TRL's method on one packed row per chunk of ``batch_size`` rollouts (module docstring)."""
        packer = self._packers["train" if self.model.training else "eval"]
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        image_start = 0
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            counts = None if num_images is None else num_images[start:end]
            chunk_vision = _vision_slice(vision, counts, image_start, start, end)
            image_start += 0 if counts is None else sum(counts)
            packed = packer(input_ids[start:end], attention_mask[start:end], logits_to_keep, counts, **chunk_vision)
            lp, ent = self._packed_chunk(model, packed, (end - start, logits_to_keep), compute_entropy)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


def _vision_slice(vision: dict[str, Any], counts: list[int] | None, image_start: int, start: int,
                  end: int) -> dict[str, Any]:
    """The vision kwargs of rollouts ``start:end`` (images ``image_start:`` on; pixel rows by image grids)."""
    out = {key: value for key, value in vision.items() if value is not None}
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = out["mm_token_type_ids"][start:end]
    if counts is None or "pixel_values" not in out:
        return out
    if "pixel_attention_mask" in out:  # one tile stack per rollout (Idefics3 / SmolVLM)
        out["pixel_values"] = out["pixel_values"][start:end]
        out["pixel_attention_mask"] = out["pixel_attention_mask"][start:end]
        return out
    tiles = out.get("num_tiles")
    if tiles is not None:  # tile-indexed pixel_values (InternVL): TRL counts tiles per rollout
        first = sum(tiles[:start])
        out["pixel_values"] = out["pixel_values"][first:first + sum(tiles[start:end])]
        out["num_tiles"] = tiles[start:end]
        return out
    image_end = image_start + sum(counts)
    grids = out.get("image_grid_thw")
    if grids is not None:
        rows = torch.cat([grids.new_zeros(1), grids.prod(-1).cumsum(0)])
        out["pixel_values"] = out["pixel_values"][int(rows[image_start]):int(rows[image_end])]
        out["image_grid_thw"] = grids[image_start:image_end]
    else:
        out["pixel_values"] = out["pixel_values"][image_start:image_end]
    if "image_sizes" in out:
        out["image_sizes"] = out["image_sizes"][image_start:image_end]
    return out


class PackedGRPOTrainer(_PackedRollouts, GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-probs come from packed rows; same arguments, plus:

    ``share_prompts`` (default True): each group's prompt and images once per forward, its completions attending
    to it (``per_device_*_batch_size`` a multiple of ``num_generations``); False: each rollout its own segment.
    ``allow_unproven``: pack a model family outside the registry at your own risk (``vlm_pack.models``).
    Refused at construction: a model family not proven on the chosen layout (``vlm_pack.models``: image-block
    families and shared prompts on linear-attention layers cannot be), MoE auxiliary losses, tools and environments.
    """

    _trl_base = GRPOTrainer

    def __init__(self, *args, share_prompts: bool = True, allow_unproven: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._setup_packing(share_prompts, allow_unproven)


class PackedRLOOTrainer(_PackedRollouts, RLOOTrainer):
    """``trl.RLOOTrainer`` with the same packed log-probs and ``share_prompts`` switch as :class:`PackedGRPOTrainer`
    (RLOO's loss and leave-one-out baseline stay TRL's)."""

    _trl_base = RLOOTrainer

    def __init__(self, *args, share_prompts: bool = True, allow_unproven: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._setup_packing(share_prompts, allow_unproven)
