"""The records a family is registered with, one per job: :class:`Proof` (what the tests show, path by path),
:class:`ModelRules` (what ``enable_packing`` and the config checks need from the model), :class:`EncodingRules`
(what the data layer needs from the family's processor: per-token keys, :class:`Positions`, :class:`VisionRows`,
which tokens never carry labels). :class:`FamilySpec` holds one of each under the family's name.

Each field is documented where it stands. The defaults describe a plain text model (causal attention, 1-D positions
restarting per sample, ``input_ids`` / ``labels`` the only per-token keys), so a family states only where it differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from ..core.packing import segment_ids

__all__ = [
    "PATHS", "PATH_TITLES", "STATIC_ROPE_TYPES", "EncodingRules", "FamilySpec", "ImageBlockRule", "ModelRules",
    "Positions", "Proof", "RowUnit", "TrainingPath", "VisionRows",
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
# taking the tiles whose tokens (``VisionRows.tile_tokens``) add up to its image tokens. "audio" one row per audio
# clip (the Omni thinkers' input_features / feature_attention_mask).
RowUnit = Literal["image", "sample", "sample_with_images", "image_token", "tile", "audio"]

# RoPE variants whose angles depend on the position id alone. Dynamic / long-rope scaling depends on the
# sequence length, which differs between a packed row and a sample run alone: not exact, so not accepted.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


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
class Proof:
    """What the tests show for one family, path by path (tests/test_registry.py checks every id is collected)."""

    sft: str
    """The test (file or pytest node id) that shows in-batch SFT exact for the family."""
    proven: Mapping[TrainingPath, str] = field(default_factory=dict)
    """``{path: pytest node id}`` of the training paths (:data:`PATHS`) beyond in-batch SFT a test shows exact. The
    default, empty, claims in-batch SFT only; every other path is refused by ``require_proven``."""
    refused: Mapping[TrainingPath, str] = field(default_factory=dict)
    """``{path: why}`` for paths the family cannot be served on (beyond the rules ``path_refusal`` derives from the
    attention): refused always, even with ``allow_unproven=True``; ``"context_parallel"`` is refused by the
    collator at construction."""
    min_transformers: str | None = None
    """The oldest transformers release the family is proven on, where later than the supported floor
    (``vlm_pack.core.versions.MINIMUM``): older releases are refused with ``UnsupportedVersionError`` naming it."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.proven) - set(PATHS) | set(self.refused) - set(PATHS))
        if unknown or "sft" in self.proven:
            raise ValueError(f"unknown training paths {unknown or ['sft']} in proven / refused (paths: "
                             f"{', '.join(PATHS[1:])}; in-batch SFT is always proven, by Proof.sft)")
        both = sorted(set(self.proven) & set(self.refused))
        if both:
            raise ValueError(f"paths {both} are both proven and refused")

    @property
    def paths(self) -> frozenset[TrainingPath]:
        """The training paths proven for this family (in-batch SFT always)."""
        return frozenset({"sft", *self.proven})


@dataclass(frozen=True)
class ModelRules:
    """What ``enable_packing`` and the config checks need from the model (defaults: a causal text model)."""

    attention: AttentionRule = "causal"
    """``"causal"``, or ``"causal_image_blocks"``: causal plus each image's tokens seeing each other both ways."""
    image_blocks: Callable[[Any], ImageBlockRule | None] | None = None
    """For ``"causal_image_blocks"``: the :class:`ImageBlockRule` of a given ``model.config`` (None where that config
    keeps images causal)."""
    layer_kinds: frozenset[str] = frozenset({"full_attention"})
    """The ``text_config.layer_types`` values handled; any other is refused."""
    rope_types: frozenset[str] = STATIC_ROPE_TYPES
    """The ``rope_type`` values accepted (the static ones: angles depending on the position id alone)."""
    extra_checks: tuple[Callable[[Any], str | None], ...] = ()
    """Config checks, each returning a problem string (refused) or None."""
    prepare_model: Callable[[Any], None] | None = None
    """Family setup run by ``enable_packing`` after the attention switch (e.g. boundary-aware linear-attention
    kernels)."""
    loss_honours_num_items: bool = True
    """The forward hands Trainer's ``num_items_in_batch`` to its own loss (true of the Qwen-VL classes even though
    they declare ``accepts_loss_kwargs = False``): ``enable_packing`` then sets ``accepts_loss_kwargs = True``. When
    False, Trainer users must pass ``compute_loss_func=vlm_pack.compute_loss_func``."""
    router_loss_mask: bool = False
    """A mixture of experts whose LM-head forward hands its ``attention_mask`` to transformers'
    ``load_balancing_loss_func`` and its inner model: ``enable_packing`` passes a packed row's real-slot mask there
    (``vlm_pack.integrations.router_loss``), so ``output_router_logits=True`` gives the padded micro-batch's aux
    loss; without it the flag is refused."""

    def __post_init__(self) -> None:
        if (self.attention == "causal_image_blocks") != (self.image_blocks is not None):
            raise ValueError("image_blocks is required exactly when attention='causal_image_blocks'")


@dataclass(frozen=True)
class Positions:
    """How the collator writes a sample's positions."""

    rule: PositionRule = "arange"
    """``"arange"`` (0..L-1 per sample) or ``"mrope"`` (a text row + rows from ``rope_index_model.get_rope_index``,
    per sample)."""
    rope_index_model: str | None = None
    """For ``"mrope"``: the transformers class whose ``get_rope_index`` computes the rope rows."""
    text_row: bool = True
    """mRoPE positions carry the per-sample text row first (``[1 + A, 1, T]``, from which HF models derive packed
    boundaries); False where the model takes only its rope rows (HunYuan-VL's forward recognises the text row but
    does not strip it, transformers 5.24): boundaries then come from ``cu_seq_lens_*`` alone."""
    alone: bool = False
    """``get_rope_index`` counts media across the rows of a batch (HunYuan-VL's image ordinal), so the collator runs
    it on each sample alone instead of once on the padded batch."""

    def __post_init__(self) -> None:
        if (self.rule == "mrope") != (self.rope_index_model is not None):
            raise ValueError("rope_index_model is required exactly when positions rule='mrope'")


@dataclass(frozen=True)
class VisionRows:
    """How the collator gives each sample its rows of the processor's per-image / per-sample tensors (tensors not
    declared here: rows per image if they match the image count, else per sample)."""

    rows: Mapping[str, RowUnit] = field(default_factory=dict)
    """``{processor key: RowUnit}`` for tensors whose rows cannot be inferred from their count alone."""
    image_token: str | None = None
    """The token each image expands into where it is not the processor's ``image_token`` (Ovis 2's ``<IMG_ATOM>``
    runs; Llama 4's ``<|patch|>`` tokens, one ``pixel_values`` row per tile): counted for ``"image_token"`` rows and
    the image-token statistics."""
    tile_tokens: Callable[[Any, Mapping[str, torch.Tensor]], list[int]] | None = None
    """``(processor, the batch's vision tensors) -> image tokens of each tile`` for ``"tile"`` rows."""
    width_packed: tuple[str, ...] = ()
    """Tensors holding ONE row whose last dimension runs over the NaViT patches of every image of the call
    (MiniCPM-V's ``pixel_values``, ``[1, C, patch, patches * patch]``): their rows are the positions along that
    dimension, and the collator joins the samples' shares along it, in sample order."""
    patch_indices: Mapping[str, str] = field(default_factory=dict)
    """``{processor key: patch key}`` for tensors whose values index the flattened patches (dims 0 and 1) of the
    patch key's tensor over the WHOLE processor call, ``-1`` for none (Molmo 2's ``image_token_pooling``): the
    collator makes each sample's indices its own and re-bases them by the patches of the samples before it."""
    tile_stacks: tuple[str, ...] = ()
    """Keys holding one stack of tiles per image (``[tiles, C, H, W]``) of different lengths (PerceptionLM's
    ``pixel_values``): the collator asks the image processor for them unstacked and flattens them to one row per
    tile (``[tiles, 1, C, H, W]``); declare their rows ``"image_token"`` when every tile has the same token count."""


@dataclass(frozen=True)
class EncodingRules:
    """What the data layer needs from the family's processor; the default is a text model's (a tokenizer)."""

    token_keys: tuple[str, ...] = ("input_ids", "labels")
    """Processor outputs with one value per token (packed like ``input_ids``); every other tensor is per image / per
    sample (:class:`VisionRows`) and concatenated in sample order."""
    positions: Positions = Positions()
    """How positions restart per sample."""
    vision: VisionRows = VisionRows()
    """How the per-image / per-sample tensors are split between samples."""
    media_tokens: tuple[str, ...] = ()
    """Tokens the processor writes around or between image / video placeholders (markers, tile separators); like
    the placeholders themselves they never carry labels. Tokens missing from the vocabulary are ignored."""
    media_spans: tuple[tuple[str, str], ...] = ()
    """``(open, close)`` token pairs: every token from an ``open`` through the next ``close`` is image markup and
    never carries labels (Aya Vision's plain-text tile labels between ``<|START_OF_IMG|>`` and ``<|END_OF_IMG|>``)."""
    mask_before_expansion: bool = False
    """``apply_chat_template`` reports the assistant mask of the text BEFORE the image expansion (Idefics2): the
    collator carries the unexpanded mask through the expansion (``vlm_pack.data.chat.carry_assistant_mask``)."""
    expansion_writes_text: bool = False
    """The image expansion writes text tokens around or between its image runs (Idefics3 row breaks, Aya Vision tile
    labels, Gemma 3's blank lines): where transformers does not shift the processor's mask for expanded
    placeholders (``vlm_pack.core.versions.GAPS``) the collator refuses the family, naming the release needed."""
    template_prefix: Callable[[Any], str] | None = None
    """``processor -> text`` the processor puts before every rendered chat after ``apply_chat_template`` recorded
    the assistant spans (Molmo2Processor's BOS): the template writes it instead
    (``vlm_pack.data.chat_template.with_prefix``), labels in place."""
    video_runs: Literal["video", "frame"] = "video"
    """How the processor writes a video's tokens, which the model's rope index relies on: one run per video
    (Qwen2-VL) or one run per temporal patch after its timestamp text (Qwen3-VL); every video sample is checked."""
    encode_alone: bool = False
    """The processor cannot encode samples of different lengths in one call (ERNIE 4.5 VL): one call per sample."""
    encode_sample: Callable[[Any, list[dict], int], dict[str, torch.Tensor]] | None = None
    """``(processor, normalised conversation, sample index) -> that sample's tensors`` (per-token keys ``[1, L]``
    with ``labels``, and its vision tensors) for processors that encode a sample by their own rule instead of a chat
    template (PaliGemma: prompt and suffix); token-budget planning counts what it returns for blank images."""
    image_text: Callable[[Any, list[tuple[int, int]]], list[tuple[str, int]]] | None = None
    """``(processor, [(h, w) of each image of ONE sample]) -> [(text, vision tokens)]``: what the processor puts in
    place of each image placeholder, for token-budget planning where ``_get_num_multimodal_tokens`` is missing or
    counts something else; None: the placeholder becomes that many image tokens."""
    expand_text: Callable[[Any, list[str]], list[list[int]]] | None = None
    """``(processor, rendered texts) -> token ids`` with the placeholders expanded by the processor's own text rule,
    for token-budget planning where the expansion needs no image size but rewrites the text (Idefics2); it replaces
    ``image_text``."""


TEXT_ENCODING = EncodingRules()
"""A text model's encoding (a tokenizer, no images): what the data layer uses where no family is given."""


@dataclass(frozen=True)
class FamilySpec:
    """One model family: its name, the ``config.model_type`` values it covers (the composite VLM config's, and the
    text model's where that is used on its own), and its :class:`Proof`, :class:`ModelRules` and
    :class:`EncodingRules`."""

    name: str
    model_types: tuple[str, ...]
    proof: Proof
    model: ModelRules = ModelRules()
    encoding: EncodingRules = TEXT_ENCODING
