"""Per-sample mRoPE position ids, from the model config alone (which model class: the family registry).

A collator has the processor and the model config, not the model. The mRoPE math lives in each family's
``<Family>Model.get_rope_index``, which only reads ``self.config`` and ``self.get_vision_position_ids``; we
call those unbound functions on a small stand-in object holding the config, so positions are computed by
exactly the code the model itself would run, with no copy of the math here and no weights allocated.

Positions must be computed PER SAMPLE: inside a packed row every sample starts again at 0. The function
below takes a right-padded ``[B, S]`` batch (one sample per row) and returns ``[4, B, S]``: row 0 the plain
text positions (0..L-1 per sample; HF models derive packed boundaries from it), rows 1-3 temporal / height /
width. Padding slots get 0 (the packer drops or overwrites them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property

import torch
import transformers
from transformers.configuration_utils import PreTrainedConfig

__all__ = ["MRopeIndex", "text_position_ids"]


def text_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions 0..L-1 over each row's real tokens (works for left or right padding), 0 at padding."""
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp_min(0)


@dataclass
class MRopeIndex:
    """Picklable callable: ``[B, S]`` padded batch -> ``[4, B, S]`` text + mRoPE position ids, per sample."""

    config: PreTrainedConfig
    rope_index_model: str
    """transformers class whose ``get_rope_index`` runs (the family registry's ``Positions.rope_index_model``)."""

    def __post_init__(self) -> None:
        if getattr(self.config, "vision_config", None) is None:
            raise ValueError("model_config has no vision_config; pass the composite model.config of the VLM")

    @cached_property
    def _accepted(self) -> frozenset[str]:
        return frozenset(inspect.signature(self._model_cls.get_rope_index).parameters)

    @property
    def _model_cls(self) -> type:
        return getattr(transformers, self.rope_index_model)

    @property
    def spatial_merge_size(self) -> int | None:
        """The vision tower's patch merge (None where it has none: MiniCPM-V merges by ``downsample_mode``)."""
        merge = getattr(self.config.vision_config, "spatial_merge_size", None)
        return None if merge is None else int(merge)

    # get_rope_index calls helpers on self (get_vision_position_ids, the Omni thinkers' get_llm_pos_ids_for_vision,
    # MiniCPM-V 4.7's _group_visual_frames): route every name this stand-in lacks, dunder names aside, to the family's
    # own implementation, bound to the stand-in (static methods stay unbound).
    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("config", "rope_index_model"):
            raise AttributeError(name)
        function = getattr(self._model_cls, name)
        if isinstance(inspect.getattr_static(self._model_cls, name), staticmethod):
            return function
        return function.__get__(self) if callable(function) else function

    def __call__(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """Position ids ``[4, B, S]`` for a padded batch; ``mm_token_type_ids`` and ``extra`` (e.g.
        ``second_per_grid_ts``) are passed on only where the family's ``get_rope_index`` takes them."""
        given = {"mm_token_type_ids": mm_token_type_ids, **extra}  # the Omni thinkers read token ids instead
        kwargs = {key: value for key, value in given.items() if key in self._accepted and value is not None}
        mrope, _ = self._model_cls.get_rope_index(
            self,
            input_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            attention_mask=attention_mask,
            **kwargs,
        )
        if mrope.is_floating_point():  # Qwen3-Omni's time-aligned index is computed in floats
            if not torch.equal(mrope, mrope.round()):
                raise ValueError(f"{self.rope_index_model}.get_rope_index gave fractional positions (media timed at "
                                 "sub-position resolution), which packed position ids cannot carry")
            mrope = mrope.long()
        text = text_position_ids(attention_mask).to(mrope.dtype)
        return torch.cat([text.unsqueeze(0), mrope], dim=0)
