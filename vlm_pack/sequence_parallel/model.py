"""The model side of Ulysses on packed rows: whole row for the vision tower, a slice for the language model.

:func:`prepare_model` (after ``enable_packing``'s checks and hooks):

* registers our packing attention a second time, under :data:`SP_ATTN_IMPLEMENTATION`, and gives that name to the
  LANGUAGE model only. accelerate wraps that name with ``UlyssesSPAttentionHF`` (which all-to-alls the heads and
  asserts ``position_ids`` reach every call); the vision tower keeps ``vlm_pack_varlen`` and runs unwrapped, on
  every image of the row. Inside the wrapper each rank holds the whole row for its heads, so the row's global
  ``cu_seq_lens_*`` / ``max_length_*`` (plain kwargs, no host sync) are exactly the boundaries its kernel needs.
* a forward pre-hook on the top model: a call carrying ``batch[SP_KEY]`` (see :mod:`.batch`) is replaced by the
  WHOLE row's inputs (input_ids, mRoPE positions, pixel values, boundaries), so the vision tower, the embedding
  merge and the rope index see what they see without sequence parallelism;
* a forward pre-hook on the language model (``model.get_decoder()``): it keeps this rank's slice of
  ``inputs_embeds`` (or ``input_ids``) and of ``position_ids`` along the last token dim (mRoPE ``[C, 1, T]``
  channels sliced together). Logits come out for the slice, aligned with the adapter's ``shift_labels``.

Gradients need no extra communication: each rank's slice sends its part back through the merge and the
replicated vision tower, and the engine's gradient reduction over the ranks sums the parts.

A family is allowed once the registry says it is proven under sequence parallelism (``Proof.proven``, each
by a case of tests/test_multiprocess.py); the others are refused by name, with the reason where one is known
(image blocks and linear attention need more than a slice). Qwen3-VL's deepstack features
(added inside the decoder at the row's vision slots) are sliced with the row: this rank's ``visual_pos_masks`` and
the matching rows of ``deepstack_visual_embeds`` (one host sync per forward, not per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..integrations.hf_model import ATTN_IMPLEMENTATION, enable_packing, register_attention
from ..core.versions import GAPS, has, installed
from ..models import UnsupportedVersionError, get_family, require_proven
from .batch import SP_KEY

__all__ = ["SHARD_KWARG", "SP_ATTN_IMPLEMENTATION", "SequenceShard", "prepare_model",
           "ulysses_shard"]

SP_ATTN_IMPLEMENTATION = "vlm_pack_varlen_sp"
"""The language model's attention name under Ulysses (accelerate wraps it; the vision tower keeps its own)."""

SHARD_KWARG = "vlm_pack_sp_shard"
"""Forward kwarg (top model -> language model) carrying this rank's :class:`SequenceShard`."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of the row: slots ``[rank * T / size, (rank + 1) * T / size)``."""

    rank: int
    size: int

    def slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        width = tensor.shape[dim]
        if width % self.size:
            raise ValueError(f"a row of {width} slots does not split over {self.size} ranks: pad it (ulysses_batch)")
        local = width // self.size
        return tensor.narrow(dim, self.rank * local, local)


def ulysses_shard() -> SequenceShard:
    """This process's :class:`SequenceShard` in DeepSpeed's sequence-parallel group (set up by accelerate)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    return SequenceShard(dist.get_rank(group), dist.get_world_size(group))


def _whole_row_hook(shard_of: Callable[[], SequenceShard]):
    def hook(module, args, kwargs):
        row = kwargs.get(SP_KEY)
        if row is None:
            return None
        if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
            raise ValueError(
                "a sequence-parallel row reached the model with labels: Trainer's own Ulysses loss is a mean of "
                "per-row means (it ignores num_items_in_batch). Train with vlm_pack.sequence_parallel.UlyssesTrainer"
            )
        rest = {k: v for k, v in kwargs.items() if k not in (SP_KEY, "input_ids", "position_ids")}
        return args, {**rest, **row, SHARD_KWARG: shard_of()}

    return hook


def _slice_hook(module, args, kwargs):
    shard: SequenceShard | None = kwargs.get(SHARD_KWARG)
    if shard is None:
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != SHARD_KWARG}
    if args:
        raise ValueError(f"{type(module).__name__} got positional inputs under sequence parallelism; pass keywords")
    for name, dim in (("inputs_embeds", 1), ("input_ids", 1)):
        if kwargs.get(name) is not None:
            kwargs[name] = shard.slice(kwargs[name], dim)
    if kwargs.get("position_ids") is None:
        raise ValueError("sequence parallelism needs the row's position_ids (the packing collators provide them)")
    kwargs["position_ids"] = shard.slice(kwargs["position_ids"], -1)
    masks = kwargs.get("visual_pos_masks")
    if masks is not None:  # Qwen3-VL's deepstack: vision features added inside the decoder at the vision slots
        inside = shard.slice(masks, -1)
        start = masks.shape[-1] // shard.size * shard.rank
        first, count = torch.stack([masks[..., :start].sum(), inside.sum()]).tolist()  # one host sync per forward
        kwargs["visual_pos_masks"] = inside
        if kwargs.get("deepstack_visual_embeds") is not None:
            kwargs["deepstack_visual_embeds"] = [e[first:first + count] for e in kwargs["deepstack_visual_embeds"]]
    return args, kwargs


def _check_heads(config, sp_size: int) -> None:
    text = config.get_text_config()
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % sp_size or (kv % sp_size and sp_size % kv):
        raise ValueError(
            f"sp_size={sp_size} must divide the attention heads ({heads}) and divide or be a multiple of the KV heads "
            f"({kv}): Ulysses gives each rank heads / sp of them; pick sp_size among the divisors of {heads}"
        )


def prepare_model(model, sp_size: int, *, shard_of: Callable[[], SequenceShard] = ulysses_shard):
    """Make ``model`` train on packed rows under DeepSpeed Ulysses with ``sp_size`` ranks (in place; returns it).

    Runs :func:`~vlm_pack.integrations.hf_model.enable_packing` (registry checks, packing hooks), refuses a family
    not proven under sequence parallelism or heads that ``sp_size`` does not divide, then installs the attention
    names and hooks described in the module docstring. ``shard_of``: where this rank's slice comes from (default:
    DeepSpeed's sequence-parallel group, created when Trainer prepares the model).
    """
    if not isinstance(sp_size, int) or sp_size < 2:
        raise ValueError(f"sp_size must be an int >= 2 (1 needs no sequence parallelism); got {sp_size!r}")
    if not has("ulysses_trainer"):
        since = GAPS["ulysses_trainer"].since
        raise UnsupportedVersionError(f"sequence parallelism (DeepSpeed Ulysses through Trainer) is proven exact from "
                                      f"transformers {since} on, not on {installed('transformers')}: pip install -U "
                                      f"'transformers>={since}'")
    require_proven(get_family(model.config), "sequence_parallel", f"prepare_model(sp_size={sp_size})",
                   allow_unproven=None)
    _check_heads(model.config, sp_size)
    enable_packing(model)
    register_attention(SP_ATTN_IMPLEMENTATION)
    try:  # DeepSpeed installs its wrapper as a local override of the name: drop an earlier Trainer's (no double wrap)
        del ALL_ATTENTION_FUNCTIONS[SP_ATTN_IMPLEMENTATION]
    except KeyError:
        pass
    vision = "vision_config" in getattr(model.config, "sub_configs", {})
    model.set_attn_implementation(
        {"": SP_ATTN_IMPLEMENTATION, "text_config": SP_ATTN_IMPLEMENTATION, "vision_config": ATTN_IMPLEMENTATION}
        if vision else SP_ATTN_IMPLEMENTATION
    )
    decoder = model.get_decoder()
    if decoder is model or decoder is None:
        raise ValueError(f"{type(model).__name__}: no separate language model (get_decoder()) to give a slice to")
    for module, hook, attribute in ((model, _whole_row_hook(shard_of), "_vlm_pack_sp_row_hook"),
                                    (decoder, _slice_hook, "_vlm_pack_sp_slice_hook")):
        if getattr(module, attribute, None) is None:
            setattr(module, attribute, module.register_forward_pre_hook(hook, with_kwargs=True))
    model._vlm_pack_sp_size = sp_size
    return model
