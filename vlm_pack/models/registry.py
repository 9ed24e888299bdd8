"""The family registry: families register themselves from their own modules (``register_family`` at import; the
package face ``vlm_pack.models`` imports the shipped ones, so they are registered before any lookup), and every entry
point asks it for a model's family (:func:`get_family`), what its config turns on that no rule covers
(:func:`check_config`), and whether a training path is proven for it (:func:`require_proven`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..core.versions import GAPS, at_least, has, installed
from .spec import PATH_TITLES, PATHS, FamilySpec, ModelRules, Proof, TrainingPath

__all__ = [
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


class UnsupportedModelError(ValueError):
    """A model (family or config feature) that vlm_pack has not proven exact under packing."""


class UnsupportedVersionError(UnsupportedModelError):
    """A family or feature proven exact only on later releases of transformers than the installed one."""


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
    unknown = sorted(set(layer_types) - spec.model.layer_kinds)
    if unknown:
        problems.append(f"layer types {unknown} (handled: {sorted(spec.model.layer_kinds)})")
    rope = getattr(text, "rope_parameters", None) or {}
    rope_kinds = {rope.get("rope_type", "default")} if "rope_type" in rope else {
        value.get("rope_type", "default") for value in rope.values() if isinstance(value, dict)
    }
    bad_rope = sorted(kind for kind in rope_kinds if kind not in spec.model.rope_types)
    if bad_rope:
        problems.append(
            f"rope_type {bad_rope} (its angles depend on the sequence length, which packing changes; "
            f"handled: {sorted(spec.model.rope_types)})"
        )
    if getattr(text, "use_bidirectional_attention", None) and spec.model.attention == "causal":
        problems.append(f"use_bidirectional_attention={text.use_bidirectional_attention!r}")
    if not spec.model.router_loss_mask and (getattr(text, "output_router_logits", False)
                                      or getattr(config, "output_router_logits", False)):
        problems.append("output_router_logits=True (the router load-balancing loss is not proven for this family; "
                        "set output_router_logits=False)")
    for check in spec.model.extra_checks:
        problem = check(config)
        if problem:
            problems.append(problem)
    return problems


def version_problems(spec: FamilySpec, config: Any) -> list[str]:
    """What ``config`` needs a later transformers for than the installed one (each naming the release)."""
    found = installed("transformers")
    problems = []
    if spec.proof.min_transformers is not None and not at_least("transformers", spec.proof.min_transformers):
        problems.append(f"the {spec.name} family is proven exact from transformers {spec.proof.min_transformers} on, not "
                        f"on {found} ({spec.proof.sft} fails there): pip install -U "
                        f"'transformers>={spec.proof.min_transformers}'")
    router = getattr(text_config(config), "output_router_logits", False) or getattr(config, "output_router_logits",
                                                                                   False)
    if router and spec.model.router_loss_mask and not has("router_loss_mask"):
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
        problems = check_config(_REGISTRY[kind], text)
        return f"language model {kind!r} with {'; '.join(problems)}" if problems else None

    return check


def get_family(config: Any, *, allow_unproven: bool = False) -> FamilySpec:
    """The spec for ``config`` (``model.config``), or :class:`UnsupportedModelError` naming what is missing.

    ``allow_unproven=True`` turns both refusals (unknown family, unhandled feature) into a warning; an unknown
    family is then packed with the plainest rule (causal attention, 1-D positions restarting per sample).
    """
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
        return FamilySpec(name=f"unproven:{model_type}", model_types=(model_type,), proof=Proof("none"),
                          model=ModelRules(layer_kinds=frozenset({"full_attention", "sliding_attention"}),
                                           loss_honours_num_items=False))
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
            "(proof for the family: " + spec.proof.sft + "). Turn the feature off, or pass allow_unproven=True "
            "at your own risk."
        )
        if not allow_unproven:
            raise UnsupportedModelError(message)
        warnings.warn(message, stacklevel=2)
    return spec


_IMAGE_BLOCK_REFUSALS: dict[str, str] = {
    "context_parallel": "bidirectional image blocks are not carried through the context-parallel split (each rank's "
                        "attention would need the block ids of its zigzag shards); use context_parallel_size=1 with "
                        "this family",
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
    ``Proof.refused`` entry, or a rule its attention implies (image blocks, linear attention)."""
    if path in spec.proof.refused:
        return spec.proof.refused[path]
    if spec.model.attention == "causal_image_blocks" and path in _IMAGE_BLOCK_REFUSALS:
        return _IMAGE_BLOCK_REFUSALS[path]
    if "linear_attention" in spec.model.layer_kinds and path in _LINEAR_ATTENTION_REFUSALS:
        return _LINEAR_ATTENTION_REFUSALS[path]
    return None


def families_proven(path: TrainingPath) -> list[str]:
    """Names of the registered families proven on ``path``, sorted."""
    return sorted(name for name, spec in registered_families().items() if path in spec.proof.paths)


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
    if path in spec.proof.paths:
        return
    proven = families_proven(path)
    message = (f"{what} with a {spec.name} model: {PATH_TITLES[path]} is not proven for this family (no test shows "
               f"it exact; proven families: {', '.join(proven) or 'none'}; see docs/families.md)")
    if not allow_unproven:
        hint = "" if allow_unproven is None else ". Pass allow_unproven=True to run it at your own risk"
        raise UnsupportedModelError(message + hint)
    warnings.warn(message, stacklevel=2)
