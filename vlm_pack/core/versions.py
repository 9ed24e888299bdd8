"""The torch and transformers releases vlm_pack supports, and what it does itself where one lacks something.

The range starts at the borrowed GPU machines' image (torch 2.11, transformers 5.17; DESIGN.md "Verified for
the fifth round"); ``scripts/check_floors.sh`` runs the test suite at these floors (result:
``benchmarks/results/floors.md``). Older releases are refused when ``vlm_pack`` is imported. Inside the range, a
behaviour vlm_pack relies on that only later releases have is a :class:`Gap`: vlm_pack covers it itself, so every
release in the range gives the same tokens, labels and attention. Each gap names the first release that has it.
Reads package metadata only (no torch or transformers import).
"""

from __future__ import annotations

from dataclasses import dataclass
import warnings
from functools import lru_cache
from importlib import metadata

from packaging.version import Version

__all__ = ["GAPS", "MINIMUM", "NEWEST_PROVEN", "Gap", "at_least", "check_supported", "has", "installed", "unproven",
           "warn_unproven_once"]

MINIMUM: dict[str, str] = {"torch": "2.11", "transformers": "5.17"}
"""The oldest release of each package vlm_pack runs on (pyproject.toml's floors)."""


NEWEST_PROVEN: dict[str, str] = {"transformers": "5.25", "accelerate": "1.16"}
"""The newest minor release of each package the suite is proven on (benchmarks/results/versions.md, written by
scripts/check_versions.sh; CI runs scripts/constraints.txt's pins). A later minor is not refused (pyproject.toml has
no upper bound: vlm_pack installs beside TRL / PEFT, which move transformers themselves, and a cap would downgrade
it or fail to resolve), but :func:`warn_unproven_once` names the proven range: most breakage of a new release is
refused by name where it is detected (a family hook, a plan, a logit transform), not all of it can be."""


@dataclass(frozen=True)
class Gap:
    """A behaviour of ``package`` from release ``since`` on that vlm_pack relies on: ``lacks`` says what an older
    release does instead, ``covered`` what vlm_pack does there."""

    package: str
    since: str
    lacks: str
    covered: str


GAPS: dict[str, Gap] = {
    "chat_template_auto_tensors": Gap(
        "transformers", "5.23",
        "ProcessorMixin.apply_chat_template forwards return_tensors='auto' flat to the processor, where it collides "
        "with the per-modality return_tensors ('Keyword argument return_tensors was passed two times')",
        "the collator leaves return_tensors out (older releases forward nothing when it is None)"),
    "vision_drops_text_varlen_kwargs": Gap(
        "transformers", "5.19",
        "get_image_features / get_video_features hand the text row's cu_seq_lens_* / max_length_* to the vision "
        "tower, whose attention would then split image patches at the text boundaries",
        "enable_packing strips them at every vision tower's forward (a forward pre-hook), on every release"),
    "processor_mask_shift": Gap(
        "transformers", "5.23",
        "return_assistant_tokens_mask is computed on the text before image placeholders are expanded, so the "
        "assistant mask (the labels) is off by each expansion",
        "the collator carries the mask of the unexpanded tokens through the expansion (carry_assistant_mask)"),
    "video_token_count": Gap(
        "transformers", "5.18",
        "Qwen2VLProcessor._get_num_multimodal_tokens(video_sizes=...) calls get_number_of_video_patches, which its "
        "video processor does not have (AttributeError)",
        "token-budget planning refuses to count such a processor's videos, naming the release"),
    "router_loss_mask": Gap(
        "transformers", "5.24",
        "the router load-balancing loss of a packed row is not the padded micro-batch's (tests/test_router_loss.py "
        "fails on transformers 5.17; no release between is measured)",
        "output_router_logits=True is refused there (vlm_pack.models.check_config)"),
    "ulysses_trainer": Gap(
        "transformers", "5.24",
        "DeepSpeed Ulysses through Trainer gives gradients 0.5-0.75 relative off the reference "
        "(tests/test_multiprocess.py on transformers 5.17; no release between is measured)",
        "vlm_pack.sequence_parallel.prepare_model (so ulysses_setup) refuses, naming the release"),
    "torch_varlen_gqa": Gap(
        "torch", "2.12",
        "torch.nn.attention.varlen.varlen_attn has no enable_gqa (grouped-query attention)",
        "backend='torch_varlen' repeats the key/value heads to the query heads (found from the signature)"),
}
"""Every known gap in the supported range, by name."""


def installed(package: str) -> Version | None:
    """The installed release of ``package`` (local tags such as ``+cu130`` kept), None if it is not installed."""
    try:
        return Version(metadata.version(package))
    except metadata.PackageNotFoundError:
        return None


def _release(version: Version | str) -> tuple[int, ...]:
    """The numeric release, so that 2.12.0.dev20260101 and 2.12.0+cu130 both count as 2.12."""
    return Version(str(version)).release


def at_least(package: str, release: str) -> bool:
    """True when the installed ``package`` is ``release`` or later (or not installed: nothing to refuse)."""
    version = installed(package)
    return version is None or _release(version) >= _release(release)


@lru_cache(maxsize=None)
def has(gap: str) -> bool:
    """True when the installed release of ``GAPS[gap].package`` has the behaviour (vlm_pack need not cover it)."""
    return at_least(GAPS[gap].package, GAPS[gap].since)


def check_supported(versions: dict[str, Version | None] | None = None) -> None:
    """Raise ``ImportError`` naming the release needed when an installed torch or transformers is older than
    ``MINIMUM`` (``versions``: ``{package: release}`` to check instead of the installed ones)."""
    versions = versions if versions is not None else {package: installed(package) for package in MINIMUM}
    too_old = {package: version for package, version in versions.items()
               if version is not None and _release(version) < _release(MINIMUM[package])}
    if too_old:
        found = ", ".join(f"{package} {version}" for package, version in too_old.items())
        needed = " ".join(f"'{package}>={MINIMUM[package]}'" for package in too_old)
        raise ImportError(f"vlm_pack needs {needed}, found {found}: pip install -U {needed}")


def unproven(versions: dict[str, Version | None] | None = None) -> dict[str, Version]:
    """``{package: release}`` of the installed packages newer than the minor in :data:`NEWEST_PROVEN` (``versions``:
    ``{package: release}`` to check instead of the installed ones)."""
    versions = versions if versions is not None else {package: installed(package) for package in NEWEST_PROVEN}
    return {package: version for package, version in versions.items() if version is not None
            and _release(version)[:2] > _release(NEWEST_PROVEN[package])[:2]}


@lru_cache(maxsize=1)
def warn_unproven_once() -> str | None:
    """Warn (once per process) when an installed package is newer than the proven range; the message, else None."""
    newer = unproven()
    if not newer:
        return None
    found = ", ".join(f"{package} {version}" for package, version in newer.items())
    proven = ", ".join(f"{package} {MINIMUM[package] + ' to ' if package in MINIMUM else 'up to '}{release}.x"
                       for package, release in NEWEST_PROVEN.items())
    message = (f"vlm_pack is proven on {proven} (benchmarks/results/versions.md); found {found}: packing may be "
               "refused or, where no check sees the change, inexact; run `bash scripts/check_versions.sh` on it or "
               "pin the proven release")
    warnings.warn(message, stacklevel=3)
    return message
