"""Model-family registry: what vlm_pack has PROVEN about each Hugging Face family, in one place per family.

Packing is exact only if four rules hold for the model at hand: attention never crosses a sample boundary
(and keeps the family's own pattern inside a sample), positions restart per sample, labels shift inside each
sample, and the loss is normalised like unpacked training. How a family meets them differs (1-D positions or
mRoPE from the model's own ``get_rope_index``; purely causal attention or bidirectional image blocks; full,
sliding or linear-attention layers), so each family declares it in a :class:`FamilySpec` in its own module
(``vlm_pack/models/<family>.py``) and everything else reads the spec:

    collator          -> positions rule, per-token processor keys
    enable_packing    -> attention rule, layer kinds, family setup hook (e.g. linear-attention kernels),
                         loss rule (whether Trainer's num_items_in_batch reaches the family's own loss)
    every other path  -> :func:`require_proven` (which training paths the family is proven on, :data:`PATHS`)

A model whose family is not registered, or whose config turns on something the spec does not cover, is
refused with an :class:`UnsupportedModelError` naming the family and the missing piece; ``allow_unproven=True``
lets such a model through with a warning (the user then owns the proof). The same holds per training path: a
registered family is proven for in-batch SFT (``proof``) and for the paths its ``proven`` names, each with the
test that shows it; any other (family, path) pair is refused by name when the trainer / collator / setup is
built (``allow_unproven=True`` where that entry point offers it: a warning instead), and a pair that cannot work
(:func:`path_refusal`: e.g. linear-attention layers split across ranks) is refused with the reason, always.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from ..core.packing import segment_ids
from ..core.versions import GAPS, at_least, has, installed

__all__ = [
    "PATHS",
    "PATH_TITLES",
    "FamilySpec",
    "ImageBlockRule",
    "TrainingPath",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "check_config",
    "families_proven",
    "get_family",
    "path_refusal",
    "register_family",
    "registered_families",
    "require_proven",
    "text_backbone",
    "text_config",
    "version_problems",
]

TrainingPath = Literal["sft", "video", "audio", "budget", "dpo", "dpo_shared_prompt", "reward", "rl",
                       "rl_shared_prompt", "sequence_parallel", "context_parallel"]
PATHS: tuple[TrainingPath, ...] = get_args(TrainingPath)
PATH_TITLES: dict[TrainingPath, str] = {
    "sft": "in-batch SFT (VLMPackingCollator + enable_packing)",
    "video": "video inputs (VLMPackingCollator)",
    "audio": "audio inputs (VLMPackingCollator)",
    "budget": "token-budget packing (vlm_pack.budget)",
    "dpo": "DPO (PackedDPOTrainer / PreferenceCollator, each sequence its own segment)",
    "dpo_shared_prompt": "DPO with shared prompts (PreferenceCollator(shared_prompts=True))",
    "reward": "reward modelling (PackedRewardTrainer)",
    "rl": "GRPO / RLOO on packed rollouts (share_prompts=False)",
    "rl_shared_prompt": "GRPO / RLOO with shared prompts (share_prompts=True)",
    "sequence_parallel": "sequence parallelism (DeepSpeed Ulysses, vlm_pack.sequence_parallel)",
    "context_parallel": "context parallelism (context_parallel_size > 1)",
}
"""Every training path a family can be proven on, and what it covers."""

PositionRule = Literal["arange", "mrope"]
AttentionRule = Literal["causal", "causal_image_blocks"]
# What one row (dim 0) of a per-sample processor tensor belongs to, so the collator can give each sample its rows:
# "image" one row per image; "sample" one per sample; "sample_with_images" one per sample holding >= 1 image
# (e.g. LLaVA-OneVision's batch_num_images); "image_token" rows in fixed proportion to the sample's image
# placeholder tokens (e.g. InternVL's tiles, whose per-image count the processor does not return).
# "tile" rows are tiles of different token counts in sample order (LFM2-VL's thumbnail and crops), each sample
# taking the tiles whose tokens (``FamilySpec.tile_tokens``) add up to its image tokens. "audio" one row per audio
# clip (the Omni thinkers' input_features / feature_attention_mask).
RowUnit = Literal["image", "sample", "sample_with_images", "image_token", "tile", "audio"]

# RoPE variants whose angles depend on the position id alone. Dynamic / long-rope scaling depends on the
# sequence length, which differs between a packed row and a sample run alone: not exact, so not accepted.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


IMAGE_BLOCKS_CONTEXT_PARALLEL_REFUSAL = (
    "bidirectional image blocks are not carried through the context-parallel split (each rank's attention would "
    "need the block ids of its zigzag shards); use context_parallel_size=1 with this family"
)


class UnsupportedModelError(ValueError):
    """A model (family or config feature) that vlm_pack has not proven exact under packing."""


class UnsupportedVersionError(UnsupportedModelError):
    """A family or feature proven exact only on later releases of transformers than the installed one."""


@dataclass(frozen=True)
class ImageBlockRule:
    """Causal attention plus bidirectional attention inside each image (Gemma 3 / Gemma 4 style).

    A block is a maximal run of consecutive tokens whose ``token_key`` value is in ``block_types`` (the rule of
    transformers' ``get_block_sequence_ids_for_mask``): its tokens see each other both ways, every other pair
    stays causal, and a layer's sliding window still bounds how far back any token looks. ``layer_types``: the
    layer kinds that apply it (Gemma 3 all, Gemma 4 sliding only). ``model_class``: the transformers class whose
    ``forward`` receives ``token_key``; ``enable_packing`` hooks it to hand the block ids to the attention.
    ``scope="sample"``: every ``block_types`` token of a sample is ONE block, across its images (Molmo 2's
    ``block_sequence_ids = where(mm_token_type_ids == 1, 0, -1)``); in a packed row each sample its own block id
    (from ``cu_seq_lens_q``), never one across samples.
    """

    token_key: str
    block_types: tuple[int, ...]
    layer_types: frozenset[str]
    model_class: str
    scope: Literal["run", "sample"] = "run"

    def block_ids(self, token_types: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` block id per token (``-1`` outside blocks; ids count up along each row), on device.
        ``cu_seqlens``: a packed row's sample boundaries, read by ``scope="sample"`` (without them each row is one
        sample)."""
        inside = torch.isin(token_types, torch.tensor(self.block_types, device=token_types.device))
        if self.scope == "sample":
            sample = (torch.zeros_like(token_types, dtype=torch.long) if cu_seqlens is None
                      else segment_ids(cu_seqlens.to(token_types.device), token_types.shape[-1]).long().expand_as(
                          token_types))
            return torch.where(inside, sample, -1)
        before = torch.nn.functional.pad(inside, (1, 0), value=False)[..., :-1]
        ids = torch.cumsum((inside & ~before).long(), dim=-1) - 1
        return torch.where(inside, ids, -1)


@dataclass(frozen=True)
class FamilySpec:
    """How one model family is packed exactly.

    ``model_types``: the ``config.model_type`` values covered (the composite VLM config's, and the text
    model's where the text model is used on its own). ``positions``: ``"arange"`` (0..L-1 per sample) or
    ``"mrope"`` (text row + rows from ``rope_index_model.get_rope_index``, per sample). ``attention``:
    ``"causal"`` or ``"causal_image_blocks"`` (causal, plus each image's tokens see each other both ways).
    ``layer_kinds``: the ``text_config.layer_types`` values handled. ``token_keys``: processor outputs with one
    value per token (packed like ``input_ids``); every other tensor is per image / per sample and is
    concatenated in sample order. ``videos``: video inputs are proven (else the collator refuses them).
    ``prepare_model``: family setup run by ``enable_packing`` after the attention switch (e.g. boundary-aware
    linear-attention kernels). ``image_blocks``: for ``"causal_image_blocks"``, the :class:`ImageBlockRule` of a
    given ``model.config`` (None where that config keeps images causal). ``extra_checks``: config checks
    returning a problem string (or None). ``proof``: the test that shows the family exact.
    ``context_parallel_refusal``: why the family cannot be split across context-parallel ranks (the collator
    then refuses ``context_parallel_size > 1`` with it); None when it can.
    ``loss_honours_num_items``: the family's forward hands Trainer's ``num_items_in_batch`` to its own loss (true
    of the Qwen-VL classes even though they declare ``accepts_loss_kwargs = False``); ``enable_packing`` then sets
    ``accepts_loss_kwargs = True`` on the model, so Trainer's loss is the exact token mean over a gradient
    accumulation window. When False, Trainer users must pass ``compute_loss_func=vlm_pack.compute_loss_func``.
    ``vision_rows``: ``{processor key: RowUnit}`` for per-sample tensors whose rows the collator cannot infer from
    their count alone (undeclared keys: rows per image if they match the image count, else per sample).
    ``image_text``: ``(processor, [(h, w) of each image of ONE sample]) -> [(text, vision tokens)]``: the text the
    family's processor puts in place of each image placeholder and its image-token count, for token-budget
    planning (``vlm_pack.budget``) where the processor's ``_get_num_multimodal_tokens`` is missing or counts
    something else; None: the placeholder becomes that many image tokens.
    ``media_tokens``: the tokens the family's processor writes around or between image / video placeholders
    (vision start/end markers, tile separators); like the placeholders themselves (``processor.image_token_id``
    / ``video_token_id``) they never carry labels, even inside an assistant turn. Tokens missing from a
    tokenizer's vocabulary are ignored. ``media_spans``: ``(open, close)`` token pairs; every token from an
    ``open`` through the next ``close`` is image markup and never carries labels (Aya Vision writes its tile
    labels "TILE_1", "TILE_2", ... as plain text between ``<|START_OF_IMG|>`` and ``<|END_OF_IMG|>``).
    ``mask_before_expansion``: the processor's ``apply_chat_template`` reports the assistant mask of the text
    BEFORE it expands each image placeholder (Idefics2's ``__call__`` returns no replacement offsets), so that mask
    is off by the expansion; the collator carries the mask of the unexpanded tokens through the expansion instead
    (``vlm_pack.data.chat.carry_assistant_mask``). ``expansion_writes_text``: the processor's image expansion writes
    text tokens around or between its image runs (Idefics3 / SmolVLM row breaks, Aya Vision tile labels, Gemma 3's
    blank lines), so that mask cannot be carried through it; transformers < 5.23 does not shift the processor's own
    mask for expanded placeholders (``vlm_pack.core.versions.GAPS``), so there the collator refuses such a family,
    naming the release needed.
    ``expand_text``: ``(processor, rendered texts) -> token ids`` of
    each text with its image placeholders expanded by the processor's own text rule, for token-budget planning of
    families whose expansion needs no image size but rewrites the text around it (Idefics2 merges the markers of
    adjacent images and puts a space after an image); it replaces ``image_text`` and the image-token count.
    ``router_loss_mask``: a mixture of experts whose LM-head forward hands its ``attention_mask`` to transformers'
    ``load_balancing_loss_func`` (which excludes padding from the router load-balancing loss) and to its inner
    model. ``enable_packing`` then passes a packed row's real-slot mask there (``vlm_pack.integrations.router_loss``),
    so ``output_router_logits=True`` gives the padded micro-batch's aux loss; without it the flag is refused.
    ``min_transformers``: the oldest transformers release the family is proven on, where it is later than the
    supported range's floor (``vlm_pack.core.versions.MINIMUM``): older releases are refused with
    :class:`UnsupportedVersionError` naming it. ``video_runs``: how the family's processor writes a video's tokens, which the model's rope index relies on:
    ``"video"`` one run per video (Qwen2-VL), ``"frame"`` one run per temporal patch, each after its timestamp text
    (Qwen3-VL, whose ``get_rope_index`` splits ``video_grid_thw`` per frame). The collator checks every video
    sample against it (a processor of another family would misplace the frames' positions).
    ``encode_alone``: the family's processor cannot encode samples of different lengths in one call (ERNIE 4.5 VL
    builds its MoE token types with ``np.array`` over ragged ids): the collator calls it once per sample.
    ``mrope_text_row``: mRoPE positions carry the per-sample text row first (``[1 + A, 1, T]``, from which HF models
    derive packed boundaries); False where the model takes only its rope rows (HunYuan-VL's forward recognises the
    text row but does not strip it, transformers 5.24): boundaries then come from ``cu_seq_lens_*`` alone.
    ``rope_index_alone``: the family's ``get_rope_index`` counts media across the rows of a batch (HunYuan-VL's
    image ordinal), so the collator runs it on each sample alone instead of once on the padded batch.
    ``image_token``: the token each image expands into where it is not the processor's ``image_token`` (Ovis 2
    replaces ``<image>`` by ``<IMG_ATOM>`` runs framed by indicator tokens; Llama 4 writes ``<|image|>`` once per image
    and one ``pixel_values`` row per tile of ``<|patch|>`` tokens): the collator counts it for
    ``"image_token"`` vision rows and its image-token statistics. ``tile_tokens``: ``(processor, the batch's vision
    tensors) -> image tokens of each tile`` for ``"tile"`` vision rows.
    ``width_packed``: processor tensors that hold ONE row whose last dimension runs over the NaViT patches of every
    image of the call (MiniCPM-V's ``pixel_values``, ``[1, C, patch, patches * patch]``): their rows for
    ``vision_rows`` are the positions along that last dimension, and the collator joins the samples' shares along
    it (one row again), in sample order.
    ``patch_indices``: ``{processor key: patch key}`` for tensors whose values index the flattened patches (dims 0
    and 1) of the patch key's tensor over the WHOLE processor call, ``-1`` for none (Molmo 2's ``image_token_pooling``
    into ``pixel_values`` ``[crops, patches, ...]``): the collator makes each sample's indices its own (counted from
    its first patch, every index inside its own patches) and re-bases them by the patches of the samples before it
    wherever samples are joined.
    ``template_prefix``: ``processor -> text`` the family's processor puts before every rendered chat after
    ``apply_chat_template`` has recorded the assistant spans (Molmo2Processor's BOS, where the text does not start
    with it), shifting every span: the collator has the template write it instead
    (``vlm_pack.data.chat_template.with_prefix``), the same tokens with the labels in place.
    ``proven``: ``{path: pytest node id}`` of the training paths (:data:`PATHS`) beyond in-batch SFT that a test
    shows exact for this family (tests/test_registry.py checks each id is a collected test). The default, empty,
    claims in-batch SFT only (``proof``); every other path is refused by :func:`require_proven`.
    ``refused``: ``{path: why}`` for paths this family cannot be served on (beyond the rules
    :func:`path_refusal` derives from the spec); refused always, even with ``allow_unproven=True``.
    ``encode_sample``: ``(processor, normalised conversation, sample index) -> that sample's tensors`` (per-token keys
    ``[1, L]`` with ``labels``, and its vision tensors), for families whose processor encodes one sample by its own
    rule instead of a chat template (PaliGemma: prompt and suffix). The collator then encodes each sample alone with
    it (no chat template), and token-budget planning counts what it returns for blank images of each size.
    ``tile_stacks``: processor keys holding one stack of tiles per image (``[tiles, C, H, W]``), the stacks of
    different lengths (PerceptionLM's ``pixel_values``, whose model flattens images x tiles): the collator asks the
    image processor for them unstacked and flattens them to one row per tile (``[tiles, 1, C, H, W]``); declare their
    rows ``"image_token"`` when every tile has the same number of image tokens.
    """

    name: str
    model_types: tuple[str, ...]
    proof: str
    positions: PositionRule = "arange"
    rope_index_model: str | None = None
    attention: AttentionRule = "causal"
    layer_kinds: frozenset[str] = frozenset({"full_attention"})
    token_keys: tuple[str, ...] = ("input_ids", "labels")
    rope_types: frozenset[str] = STATIC_ROPE_TYPES
    prepare_model: Callable[[Any], None] | None = None
    loss_honours_num_items: bool = True
    image_blocks: Callable[[Any], ImageBlockRule | None] | None = None
    extra_checks: tuple[Callable[[Any], str | None], ...] = field(default=())
    context_parallel_refusal: str | None = None
    vision_rows: Mapping[str, RowUnit] = field(default_factory=dict)
    image_text: Callable[[Any, list[tuple[int, int]]], list[tuple[str, int]]] | None = None
    media_tokens: tuple[str, ...] = ()
    media_spans: tuple[tuple[str, str], ...] = ()
    mask_before_expansion: bool = False
    expansion_writes_text: bool = False
    expand_text: Callable[[Any, list[str]], list[list[int]]] | None = None
    router_loss_mask: bool = False
    min_transformers: str | None = None
    video_runs: Literal["video", "frame"] = "video"
    encode_alone: bool = False
    mrope_text_row: bool = True
    rope_index_alone: bool = False
    image_token: str | None = None
    tile_tokens: Callable[[Any, Mapping[str, torch.Tensor]], list[int]] | None = None
    width_packed: tuple[str, ...] = ()
    patch_indices: Mapping[str, str] = field(default_factory=dict)
    template_prefix: Callable[[Any], str] | None = None
    proven: Mapping[TrainingPath, str] = field(default_factory=dict)
    refused: Mapping[TrainingPath, str] = field(default_factory=dict)

    @property
    def paths(self) -> frozenset[TrainingPath]:
        """The training paths proven for this family (in-batch SFT always)."""
        return frozenset({"sft", *self.proven})
    encode_sample: Callable[[Any, list[dict], int], dict[str, torch.Tensor]] | None = None
    tile_stacks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.proven) - set(PATHS) | set(self.refused) - set(PATHS))
        if unknown or "sft" in self.proven:
            raise ValueError(f"family {self.name!r}: unknown training paths {unknown or ['sft']} in proven / refused "
                             f"(paths: {', '.join(PATHS[1:])}; in-batch SFT is always proven, by proof=)")
        both = sorted(set(self.proven) & set(self.refused))
        if both:
            raise ValueError(f"family {self.name!r}: paths {both} are both proven and refused")
        if (self.positions == "mrope") != (self.rope_index_model is not None):
            raise ValueError(f"family {self.name!r}: rope_index_model is required exactly when positions='mrope'")
        if (self.attention == "causal_image_blocks") != (self.image_blocks is not None):
            raise ValueError(f"family {self.name!r}: image_blocks is required exactly when "
                             "attention='causal_image_blocks'")


_REGISTRY: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` under each of its model types (a type may belong to one family only)."""
    for model_type in spec.model_types:
        owner = _REGISTRY.get(model_type)
        if owner is not None and owner.name != spec.name:
            raise ValueError(f"model_type {model_type!r} is already registered by family {owner.name!r}")
        _REGISTRY[model_type] = spec
    return spec


def registered_families() -> dict[str, FamilySpec]:
    """``{family name: spec}`` of every registered family."""
    _load_builtin()
    return {spec.name: spec for spec in _REGISTRY.values()}


def _model_type(config: Any) -> str:
    return str(getattr(config, "model_type", None))


def text_config(config: Any) -> Any:
    """The language model's config of a composite VLM config (the config itself for a text model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_config(spec: FamilySpec, config: Any) -> list[str]:
    """What ``config`` turns on that ``spec`` does not handle (empty when the model is covered)."""
    text = text_config(config)
    problems = []
    layer_types = getattr(text, "layer_types", None) or ()
    unknown = sorted(set(layer_types) - spec.layer_kinds)
    if unknown:
        problems.append(f"layer types {unknown} (handled: {sorted(spec.layer_kinds)})")
    rope = getattr(text, "rope_parameters", None) or {}
    rope_kinds = {rope.get("rope_type", "default")} if "rope_type" in rope else {
        value.get("rope_type", "default") for value in rope.values() if isinstance(value, dict)
    }
    bad_rope = sorted(kind for kind in rope_kinds if kind not in spec.rope_types)
    if bad_rope:
        problems.append(
            f"rope_type {bad_rope} (its angles depend on the sequence length, which packing changes; "
            f"handled: {sorted(spec.rope_types)})"
        )
    if getattr(text, "use_bidirectional_attention", None) and spec.attention == "causal":
        problems.append(f"use_bidirectional_attention={text.use_bidirectional_attention!r}")
    if not spec.router_loss_mask and (getattr(text, "output_router_logits", False)
                                      or getattr(config, "output_router_logits", False)):
        problems.append("output_router_logits=True (the router load-balancing loss is not proven for this family; "
                        "set output_router_logits=False)")
    for check in spec.extra_checks:
        problem = check(config)
        if problem:
            problems.append(problem)
    return problems


def version_problems(spec: FamilySpec, config: Any) -> list[str]:
    """What ``config`` needs a later transformers for than the installed one (each naming the release)."""
    found = installed("transformers")
    problems = []
    if spec.min_transformers is not None and not at_least("transformers", spec.min_transformers):
        problems.append(f"the {spec.name} family is proven exact from transformers {spec.min_transformers} on, not "
                        f"on {found} ({spec.proof} fails there): pip install -U "
                        f"'transformers>={spec.min_transformers}'")
    router = getattr(text_config(config), "output_router_logits", False) or getattr(config, "output_router_logits",
                                                                                   False)
    if router and spec.router_loss_mask and not has("router_loss_mask"):
        since = GAPS["router_loss_mask"].since
        problems.append(f"output_router_logits=True: the packed router load-balancing loss is proven from "
                        f"transformers {since} on, not on {found}: pip install -U 'transformers>={since}' or set "
                        "output_router_logits=False")
    return problems


def text_backbone(*model_types: str) -> Callable[[Any], str | None]:
    """An ``extra_checks`` entry for composite VLMs: the language model must be one of ``model_types`` (each a
    registered, proven text family) and pass that family's own checks (e.g. sliding windows, rope scaling)."""

    def check(config: Any) -> str | None:
        text = config.get_text_config()
        kind = _model_type(text)
        if kind not in model_types:
            return f"language model {kind!r} (proven language models for this family: {', '.join(model_types)})"
        _load_builtin()
        problems = check_config(_REGISTRY[kind], text)
        return f"language model {kind!r} with {'; '.join(problems)}" if problems else None

    return check


def get_family(config: Any, *, allow_unproven: bool = False) -> FamilySpec:
    """The spec for ``config`` (``model.config``), or :class:`UnsupportedModelError` naming what is missing.

    ``allow_unproven=True`` turns both refusals (unknown family, unhandled feature) into a warning; an unknown
    family is then packed with the plainest rule (causal attention, 1-D positions restarting per sample).
    """
    _load_builtin()
    model_type = _model_type(config)
    spec = _REGISTRY.get(model_type)
    if spec is None:
        from .missing import MISSING_RULES

        missing = MISSING_RULES.get(model_type)
        if missing is not None:
            message = (
                f"model_type {model_type!r}: {missing.rule}. allow_unproven=True would pack it as a causal "
                f"1-D-position model, and then {missing.unproven}."
            )
        else:
            message = (
                f"model_type {model_type!r} is not a family vlm_pack has proven exact under packing (supported: "
                f"{', '.join(sorted(_REGISTRY))}). Pass the composite model.config of a VLM (not its text_config), "
                "or allow_unproven=True to pack it as a causal 1-D-position model at your own risk."
            )
        if not allow_unproven:
            raise UnsupportedModelError(message)
        warnings.warn(message, stacklevel=2)
        return FamilySpec(name=f"unproven:{model_type}", model_types=(model_type,), proof="none",
                          layer_kinds=frozenset({"full_attention", "sliding_attention"}), loss_honours_num_items=False)
    too_old = version_problems(spec, config)
    if too_old:
        message = f"{spec.name} model: {'; '.join(too_old)}"
        if not allow_unproven:
            raise UnsupportedVersionError(message)
        warnings.warn(message, stacklevel=2)
    problems = check_config(spec, config)
    if problems:
        message = (
            f"{spec.name} model with {'; '.join(problems)}: packing this configuration is not proven exact "
            "(proof for the family: " + spec.proof + "). Turn the feature off, or pass allow_unproven=True "
            "at your own risk."
        )
        if not allow_unproven:
            raise UnsupportedModelError(message)
        warnings.warn(message, stacklevel=2)
    return spec


_IMAGE_BLOCK_REFUSALS: dict[str, str] = {
    "sequence_parallel": "its bidirectional image blocks are not proven across the Ulysses all-to-all",
    "rl": "its bidirectional image blocks are not proven for packed rollouts; use TRL's trainer",
    "rl_shared_prompt": "its bidirectional image blocks are not proven for packed rollouts; use TRL's trainer",
    "dpo_shared_prompt": "its bidirectional image blocks need self-attention segments, which the shared-prompt rule "
                         "replaces; use shared_prompts=False",
}
_LINEAR_ATTENTION_REFUSALS: dict[str, str] = {
    "sequence_parallel": "its linear-attention (recurrent) layers need the whole sequence on one rank",
    "rl_shared_prompt": "its linear-attention layers carry a recurrent state that cannot be shared; use "
                        "share_prompts=False",
    "dpo_shared_prompt": "its linear-attention layers carry a recurrent state that cannot be shared; use "
                         "shared_prompts=False",
}


def path_refusal(spec: FamilySpec, path: TrainingPath) -> str | None:
    """Why ``spec``'s family cannot be served on ``path`` at all (None: it can, once proven): the family's own
    ``refused`` entry, its ``context_parallel_refusal``, or a rule its attention implies (image blocks, linear
    attention)."""
    if path in spec.refused:
        return spec.refused[path]
    if path == "context_parallel":
        return spec.context_parallel_refusal
    if spec.attention == "causal_image_blocks" and path in _IMAGE_BLOCK_REFUSALS:
        return _IMAGE_BLOCK_REFUSALS[path]
    if "linear_attention" in spec.layer_kinds and path in _LINEAR_ATTENTION_REFUSALS:
        return _LINEAR_ATTENTION_REFUSALS[path]
    return None


def families_proven(path: TrainingPath) -> list[str]:
    """Names of the registered families proven on ``path``, sorted."""
    return sorted(name for name, spec in registered_families().items() if path in spec.paths)


def require_proven(spec: FamilySpec, path: TrainingPath, what: str, *, allow_unproven: bool | None = False) -> None:
    """Refuse ``what`` (the trainer / collator / setup being built) unless ``spec``'s family is proven on ``path``.

    A :func:`path_refusal` raises always. An unproven pair raises :class:`UnsupportedModelError` naming the family,
    the path and the families proven on it; ``allow_unproven=True`` turns that into a warning (the caller's own
    escape hatch); ``None``: the entry point offers no escape hatch (the message then suggests none).
    """
    if path not in PATHS:
        raise ValueError(f"unknown training path {path!r}; choose one of {', '.join(PATHS)}")
    reason = path_refusal(spec, path)
    if reason is not None:
        raise UnsupportedModelError(f"{what} with a {spec.name} model: {reason}")
    if path in spec.paths:
        return
    proven = families_proven(path)
    message = (f"{what} with a {spec.name} model: {PATH_TITLES[path]} is not proven for this family (no test shows "
               f"it exact; proven families: {', '.join(proven) or 'none'}; see docs/families.md)")
    if not allow_unproven:
        hint = "" if allow_unproven is None else ". Pass allow_unproven=True to run it at your own risk"
        raise UnsupportedModelError(message + hint)
    warnings.warn(message, stacklevel=2)


_loaded = False


def _load_builtin() -> None:
    """Import the family modules shipped with vlm_pack (each registers itself); once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import (  # noqa: F401
        aya_vision, deepseek_vl, fast_vlm, gemma3, gemma3n, gemma4, glm4v, glm4v_moe, glm46v, glm_ocr, granite4_vision,
        granite_docling, idefics2, idefics3, internvl, lighton_ocr, llama, llama4, llava, llava_onevision, mistral,
        mllama, paligemma, perception_lm, phi4_multimodal, qwen3_5, qwen3_5_moe, qwen3_vl_moe, qwen_vl,
    )
    from . import aria, ernie4_5_vl_moe, hunyuan_vl, lfm2_vl, ovis2, paddleocr_vl, qianfan_ocr, qwen_omni  # noqa: F401
    from . import minicpmv4_6, minicpmv4_7, molmo2  # noqa: F401
    from . import gemma4_unified, kimi_k25, lfm3_vl, mistral4, qwen2_audio, video_llama_3  # noqa: F401
