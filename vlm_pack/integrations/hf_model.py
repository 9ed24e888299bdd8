"""Hugging Face integration: packed rows through any AttentionInterface model, no monkey-patching.

``enable_packing(model)`` registers our attention under ``ATTN_IMPLEMENTATION`` and switches the model to it.
Then a packed forward is ``model(input_ids=..., position_ids=..., use_cache=False, **batch.attention_kwargs())``:
the layers receive ``cu_seq_lens_q/k`` / ``max_length_q/k`` as kwargs and we call ``varlen_attention``.
Calls without boundaries (vision towers run once per image, non-causal; ordinary unpacked batches) go to dense
SDPA honouring ``is_causal`` and any mask. A packed row sent with position ids but no ``cu_seq_lens_*`` (e.g.
``DataCollatorWithFlattening`` defaults) is still exact: boundaries are read from the position ids, once per
forward (one device sync), with a one-time warning.

Where flash-attn is installed, ``attn_implementation="flash_attention_2"`` consumes the same ``cu_seq_lens_*``
kwargs natively (tested on GPU in tests/test_hf_integration.py).

Families with bidirectional image blocks (Gemma 3): ``enable_packing`` adds a forward pre-hook to the model class
named by the family's :class:`~vlm_pack.models.ImageBlockRule`. It turns the per-token ``token_type_ids`` of
that forward into block ids and passes them down as the ``vlm_pack_image_blocks`` kwarg (an
:class:`ImageBlocks`), which transformers forwards to every attention call of the same forward (gradient
checkpointing included). The attention then adds "same image block" to its causal rule (flex or per-segment
SDPA; the varlen kernels cannot express it).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention.cross import CROSS_ATTENTION_FLAG, CROSS_KEYS_KWARG, segment_cross_attention
from ..attention.varlen import dense_attention, sdpa, varlen_attention
from ..core.packing import chunk_boundaries
from ..models import ImageBlockRule, get_family, text_config
from ..attention.shared_prefix import SHARED_PREFIX_KWARG, gather_shared_keys
from .head_loss import install_hidden_loss
from .router_loss import install_router_loss_mask
from .token_mean import install_token_mean_check

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DISPATCH_FIX",
    "IMAGE_BLOCKS_KWARG",
    "ImageBlocks",
    "enable_packing",
    "keep_batches_whole",
    "packed_forward_hook",
    "packing_attention_forward",
    "packing_mask",
    "refuse_dispatch",
    "register_attention",
]

ATTN_IMPLEMENTATION = "vlm_pack_varlen"
"""The name our implementation is registered under (no "flash" in it: see DESIGN.md)."""

IMAGE_BLOCKS_KWARG = "vlm_pack_image_blocks"
"""Forward kwarg that carries an :class:`ImageBlocks` from the family's model class down to the attention."""

logger = logging.getLogger(__name__)
_warned_position_ids = False
# Boundaries inferred from the last position_ids tensor seen: every layer of one forward shares that tensor.
_position_cache: tuple[weakref.ref, int, tuple[torch.Tensor, int] | None] | None = None
# Chunk boundaries of the last (cu_seqlens tensor, chunk size) seen: every chunked layer of one forward shares them.
_chunk_cache: tuple[weakref.ref, int, int, tuple[torch.Tensor, int]] | None = None


@dataclass(eq=False)
class ImageBlocks:
    """Image-block ids of the batch in flight and the layer kinds that honour them.

    ``ids``: ``[B, T]`` (``-1`` outside image blocks). ``plans``: filled by the attention backend with what it
    derives once per batch (FlexAttention's block mask), reused by every later layer of the same forward.
    """

    ids: torch.Tensor
    layer_types: frozenset[str]
    plans: dict = field(default_factory=dict)


def _layer_type(module: torch.nn.Module, sliding_window: int | None) -> str:
    """The attention layer's kind: its own ``layer_type`` when set, else sliding iff it has a window."""
    kind = getattr(module, "layer_type", None)
    if kind is not None:
        return kind
    return "sliding_attention" if sliding_window is not None else "full_attention"


def _block_hook(rule: ImageBlockRule):
    """Forward pre-hook (with kwargs): ``rule.token_key`` -> ``IMAGE_BLOCKS_KWARG`` for this forward."""

    def hook(module, args, kwargs):
        token_types = kwargs.get(rule.token_key)
        if token_types is None:
            if kwargs.get("pixel_values") is not None:
                raise ValueError(
                    f"{type(module).__name__} got pixel_values without {rule.token_key}: its image tokens would attend "
                    f"causally instead of bidirectionally. Pass the processor's {rule.token_key} (VLMPackingCollator "
                    "packs it per token)."
                )
            return None
        ids = rule.block_ids(token_types, cu_seqlens=kwargs.get("cu_seq_lens_q"))  # read by scope="sample" only
        return args, {**kwargs, IMAGE_BLOCKS_KWARG: ImageBlocks(ids, rule.layer_types)}

    return hook


def _install_image_blocks(model: torch.nn.Module, rule: ImageBlockRule) -> None:
    """Hook every ``rule.model_class`` inside ``model`` once (``enable_packing`` may be called again)."""
    target = getattr(transformers, rule.model_class)
    hooked = 0
    for module in model.modules():
        if isinstance(module, target):
            if getattr(module, "_vlm_pack_block_hook", None) is None:
                module._vlm_pack_block_hook = module.register_forward_pre_hook(_block_hook(rule), with_kwargs=True)
            hooked += 1
    if hooked == 0:
        raise ValueError(
            f"{type(model).__name__} holds no {rule.model_class}: cannot read {rule.token_key} for its image blocks. "
            "Call enable_packing on the full model (e.g. the ...ForConditionalGeneration)."
        )


DISPATCH_FIX = 'accelerator_config={"dispatch_batches": False}'
"""The ``TrainingArguments`` / ``SFTConfig`` argument that keeps accelerate from slicing packed batches."""


def refuse_dispatch(args: Any, trainer: str) -> None:
    """Before a packed trainer is built: an explicit ``dispatch_batches=True`` is refused (it cuts packed rows)."""
    if args is not None and args.accelerator_config.dispatch_batches:
        raise ValueError(f"{trainer}: dispatch_batches=True cuts packed batches apart; pass {DISPATCH_FIX}")


def keep_batches_whole(trainer: Any) -> None:
    """On a built ``Trainer``: ``dispatch_batches`` off for the arguments and the accelerator it already built.

    accelerate's default for an ``IterableDataset`` (a streamed train OR eval set) slices every tensor of a batch
    along dim 0, which no packed batch survives; each process then reads and packs its own samples instead. The
    dataloaders are built later (``train()`` / ``evaluate()``), so both settings take effect.
    """
    trainer.args.accelerator_config.dispatch_batches = False
    trainer.accelerator.dataloader_config.dispatch_batches = False


def packed_forward_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of every (sub-)model taking ``use_cache``, for a call that carries ``cu_seq_lens_q``.

    * ``use_cache=None`` becomes False: a packed row never fills a KV cache (the config is not touched);
    * a batch that accelerate's ``dispatch_batches`` cut is refused. With it on (Trainer's default for an
      ``IterableDataset``), accelerate slices every tensor of the batch along dim 0 to the process's share
      (``find_batch_size`` reads ``input_ids``' 1 row), so ``cu_seq_lens_q`` arrives as one entry and mRoPE positions
      / vision tensors lose rows. No packed layout survives that (in several processes it also concatenates rows
      of different widths), so the fix is to switch it off: each process then reads and packs its own samples.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return None
    if cu.numel() < 2:
        raise ValueError(
            f"the packed batch reached {type(module).__name__} cut to pieces (cu_seq_lens_q = {cu.tolist()}, a packed "
            "row needs [0, ..., T]): accelerate's dispatch_batches, on by default for an IterableDataset (streaming) "
            "in Trainer and TRL, slices every batch tensor along dim 0. Pass TrainingArguments(..., "
            f"{DISPATCH_FIX}) (SFTConfig takes it too)"
        )
    if kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None


# The text row's varlen kwargs (transformers' names): the boundaries of the packed TEXT row, never of a vision tower's.
_TEXT_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _drop_text_varlen_kwargs(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of an encoder sub-model (a vision tower): the text row's ``cu_seq_lens_*`` /
    ``max_length_*`` are dropped. transformers < 5.19 hands them from ``get_image_features`` to the tower
    (``vlm_pack.core.versions.GAPS``), whose attention would then split image patches at text boundaries; the tower
    derives its own boundaries from the image grid."""
    if not any(key in kwargs for key in _TEXT_VARLEN_KWARGS):
        return None
    return args, {key: value for key, value in kwargs.items() if key not in _TEXT_VARLEN_KWARGS}


def _install_forward_hooks(model: torch.nn.Module) -> None:
    """On sub-models (once per module): ``packed_forward_hook`` on every one whose forward takes ``use_cache`` (the
    top one runs first; inner ones still run when a wrapper calls the top model's ``.forward`` directly);
    ``_drop_text_varlen_kwargs`` on every encoder, a sub-model with a config of its own (neither the model's nor its
    language model's: a vision tower)."""
    own_configs = (model.config, text_config(model.config))
    for module in model.modules():
        if getattr(module, "_vlm_pack_forward_hook", None) is not None:
            continue
        if not isinstance(module, transformers.PreTrainedModel):
            continue
        if "use_cache" in inspect.signature(module.forward).parameters:
            module._vlm_pack_forward_hook = module.register_forward_pre_hook(packed_forward_hook, with_kwargs=True)
        elif all(module.config is not config for config in own_configs):
            module._vlm_pack_forward_hook = module.register_forward_pre_hook(_drop_text_varlen_kwargs,
                                                                             with_kwargs=True)


def packing_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask function for our name: None (a varlen kernel needs no T x T mask) unless real padding is present.

    A 2-D mask with padding (an ordinary padded, unpacked batch) is expanded like sdpa's, so that batch stays
    exact on the dense path. An all-ones mask is dropped, so it can never hide packed boundaries.
    """
    if attention_mask is None or (attention_mask.dim() == 2 and bool(attention_mask.all())):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _boundaries_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens, max_seqlen) where a ``[1, S]`` row's position ids restart; None for a single sequence."""
    global _position_cache, _warned_position_ids
    if _position_cache is not None:
        ref, version, result = _position_cache
        if ref() is position_ids and version == position_ids._version:
            return result
    row = position_ids.reshape(-1)
    starts = torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1
    result = None
    if starts.numel() > 0:  # the host sync happens here, once per forward
        zero = starts.new_zeros(1)
        cu = torch.cat([zero, starts, starts.new_full((1,), row.numel())]).to(torch.int32)
        result = (cu, int(cu.diff().max()))
        if not _warned_position_ids:
            logger.warning(
                "vlm_pack: packed boundaries inferred from position_ids (one device sync per forward); pass "
                "cu_seq_lens_q/k and max_length_q/k (PackedBatch.attention_kwargs()) to avoid it"
            )
            _warned_position_ids = True
    _position_cache = (weakref.ref(position_ids), position_ids._version, result)
    return result


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked local-attention layer (transformers' ``"chunked_attention"`` layer kind, Llama 4:
    causal inside pieces of ``config.attention_chunk_size`` tokens counted from the sequence start), else None."""
    config = getattr(module, "config", None)
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is None or index is None or layer_types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _chunked(cu: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """``chunk_boundaries(cu, chunk)``, computed once per forward (one host read) and shared by its chunked layers."""
    global _chunk_cache
    if _chunk_cache is not None:
        ref, version, size, result = _chunk_cache
        if ref() is cu and version == cu._version and size == chunk:
            return result
    result = chunk_boundaries(cu, chunk)
    _chunk_cache = (weakref.ref(cu), cu._version, chunk, result)
    return result


def packing_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S_k, D]`` -> ``[B, S, Hq, Dv]``."""
    if dropout:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} has no attention dropout (got {dropout}); set config.attention_dropout=0"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION} does not support attention sinks")
    if getattr(module, CROSS_ATTENTION_FLAG, False) and kwargs.get("cu_seq_lens_q") is not None:
        if softcap is not None:
            raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: packed cross-attention has no logit softcapping")
        keys = kwargs.get(CROSS_KEYS_KWARG)
        if keys is None:
            raise ValueError(f"{type(module).__name__} got a packed row without its samples' media segments "
                             f"({CROSS_KEYS_KWARG}): call enable_packing on the full model")
        return segment_cross_attention(query, key, value, attention_mask, kwargs["cu_seq_lens_q"], keys, scaling), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    batch, heads, q_len, _ = query.shape
    blocks: ImageBlocks | None = kwargs.get(IMAGE_BLOCKS_KWARG)
    if blocks is not None and not (causal and _layer_type(module, sliding_window) in blocks.layer_types):
        blocks = None  # bidirectional calls see the whole block anyway; other layer kinds keep images causal

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if (cu_q is None and attention_mask is None and causal and batch == 1 and q_len > 1
            and key.shape[2] == q_len and kwargs.get("position_ids") is not None):
        inferred = _boundaries_from_position_ids(kwargs["position_ids"])
        if inferred is not None:
            cu_q, max_q = inferred
    chunk = _attention_chunk(module)
    if chunk is not None and attention_mask is None:
        # Chunked local attention is causal attention over the pieces of each sequence cut every `chunk` tokens
        # from its start; an unpacked batch (no padding mask) is B sequences of q_len. With a padding mask,
        # transformers' own chunked mask (built by packing_mask) is used below.
        if key.shape[2] != q_len or not causal:
            raise NotImplementedError(
                f"{ATTN_IMPLEMENTATION}: chunked attention needs causal self-attention with as many keys as queries "
                f"(got {q_len} queries, {key.shape[2]} keys; a KV cache is not supported): generate with "
                "attn_implementation='sdpa'"
            )
        if blocks is not None or kwargs.get(SHARED_PREFIX_KWARG) is not None:
            raise ValueError("chunked attention cannot be combined with image blocks or shared prompts")
        if cu_q is None:
            cu_q = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * q_len
        cu_q, max_q = _chunked(cu_q, chunk)
        cu_k, max_k = cu_q, max_q
    if cu_q is not None:
        if attention_mask is not None:
            raise ValueError(
                "a packed row got both cu_seq_lens_q and a padding attention_mask: drop attention_mask (packed "
                "rows carry their boundaries in cu_seq_lens_*; padding slots belong to a fill segment)"
            )
        shared = kwargs.get(SHARED_PREFIX_KWARG)
        if shared is not None and causal:  # pairs sharing their prompt: see vlm_pack.attention.shared_prefix
            if blocks is not None:
                raise ValueError(f"{SHARED_PREFIX_KWARG} cannot be combined with bidirectional image blocks")
            key, value, cu_k, max_k = gather_shared_keys(shared, key, value)
        if cu_k is None:
            cu_k, max_k = cu_q, max_q if max_k is None else max_k
        out = varlen_attention(
            query.transpose(1, 2).reshape(-1, heads, query.shape[-1]),
            key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1]),
            value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1]),
            cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scaling, window=window,
            block_ids=None if blocks is None else blocks.ids, plan_cache=None if blocks is None else blocks.plans,
            softcap=softcap,
        )
        return out.view(batch, q_len, heads, value.shape[-1]), None

    if attention_mask is not None:  # a complete mask built by transformers (padding, causal, window)
        out = sdpa(query, key, value, attention_mask, scale=scaling, softcap=softcap)
    else:
        out = dense_attention(query, key, value, causal=causal, softmax_scale=scaling, window=window,
                              block_ids=None if blocks is None else blocks.ids, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def register_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the packing attention and its mask function with transformers under ``name``; returns it.

    A model switched to ``name`` by hand gets the attention only: :func:`enable_packing` also checks the family and
    hooks the model (e.g. keeps the text row's boundaries out of a VLM's vision tower on transformers < 5.19)."""
    if "flash" in name.lower():
        raise ValueError(
            f"attention implementation name {name!r} contains 'flash': transformers would then demand flash-attn "
            "at model construction; pick another name (default 'vlm_pack_varlen')"
        )
    AttentionInterface.register(name, packing_attention_forward)
    AttentionMaskInterface.register(name, packing_mask)
    return name


def enable_packing(model, name: str = ATTN_IMPLEMENTATION, *, allow_unproven: bool = False, chunked_loss: bool = True,
                   loss_chunk_tokens: int | None = None):
    """Switch ``model`` (and its sub-models, e.g. a vision tower) to packed attention in place; returns it.

    The model's family must be in the registry (``vlm_pack.models``) with every feature of its config covered,
    else :class:`~vlm_pack.models.UnsupportedModelError` names what is missing (``allow_unproven=True``: a
    warning instead). The family's own setup (e.g. boundary-aware linear-attention kernels, the image-block hook
    of Gemma 3 / 4) is applied too, and ``accepts_loss_kwargs`` is set where the family's loss honours Trainer's ``num_items_in_batch`` (see
    :class:`~vlm_pack.models.ModelRules`), so ``Trainer(model=enable_packing(model), data_collator=collator)`` is
    exact under gradient accumulation with nothing else passed.
    A forward that carries ``cu_seq_lens_q`` (a packed row) runs with ``use_cache=False`` unless the call says
    otherwise (a packed row must never fill a cache, and ``model(**batch)``, as Trainer and TRL call it, passes no
    ``use_cache``); the config is left alone, so a checkpoint saved later keeps the user's ``use_cache`` and
    ``generate()`` caches as before. A packed batch cut by accelerate's ``dispatch_batches`` is refused with the
    fix (:func:`packed_forward_hook`). Never pass an ``attention_mask`` with a packed row. Mixture-of-experts
    families with ``output_router_logits``: the router load-balancing loss of a packed row is that of the padded
    micro-batch, alignment slots excluded (:mod:`vlm_pack.integrations.router_loss`).

    ``chunked_loss`` (default on): a training forward with labels computes its loss from the final hidden states,
    the LM head applied in chunks of ``loss_chunk_tokens`` target slots (None: 64 MiB of fp32 logits per chunk) and
    recomputed in the backward, so a long row never holds its ``T x V`` logits; ``logits`` are computed only when
    used (:mod:`vlm_pack.integrations.head_loss`). ``chunked_loss=False`` keeps the model's own loss.
    """
    family = get_family(model.config, allow_unproven=allow_unproven)
    register_attention(name)
    model.set_attn_implementation(name)
    _install_forward_hooks(model)
    rule = None if family.model.image_blocks is None else family.model.image_blocks(model.config)
    if rule is not None:
        _install_image_blocks(model, rule)
    if family.model.prepare_model is not None:
        family.model.prepare_model(model)
    if family.model.router_loss_mask:  # the router aux loss over the real slots only (vlm_pack.integrations.router_loss)
        install_router_loss_mask(model)
    if family.model.loss_honours_num_items:
        # Trainer reads this flag to pass num_items_in_batch (the window's label-token count) to the model's loss:
        # the exact token mean under gradient accumulation, as unpacked training over the same window.
        model.accepts_loss_kwargs = True
        install_token_mean_check(model)  # warns when that count is per rank (average_tokens_across_devices=False)
    else:
        logger.warning(
            "vlm_pack: the %s family's own loss ignores Trainer's num_items_in_batch; under gradient accumulation "
            "pass compute_loss_func=vlm_pack.compute_loss_func to Trainer for the exact token mean", family.name
        )
    if chunked_loss:  # last: its pre-hook takes the labels out of the call, after the hooks above have read them
        install_hidden_loss(model, loss_chunk_tokens)
    return model
