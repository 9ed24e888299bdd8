"""Tests that depend on the installed transformers: a family proven from a later release (``Proof.min_transformers``)
or a feature behind a gap (``vlm_pack.core.versions.GAPS``) is refused there with ``UnsupportedVersionError`` naming
the release. Its tiny fixture may not even build on the older release (transformers 5.17 has no Granite Docling,
its AriaProcessor no ``images_kwargs``), so a test of such a family is skipped before building it, with the release
as the reason; a refusal test expects the version refusal, which comes first, instead of the path's own.
The floor run (scripts/check_floors.sh) lists the skips.
"""

from __future__ import annotations

import re

import pytest

from vlm_pack.core.versions import GAPS, at_least, has, installed
from vlm_pack.models import UnsupportedVersionError, registered_families


def proven_from(family: str) -> str | None:
    """The release ``family`` is proven from where the installed transformers is older, else None."""
    spec = registered_families().get(family)
    release = spec.proof.min_transformers if spec is not None else None
    return release if release is not None and not at_least("transformers", release) else None


def require_proven(family: str) -> None:
    """Skip the calling test where ``family`` is proven only from a later transformers than the installed one."""
    release = proven_from(family)
    if release is not None:
        pytest.skip(f"the {family} family is proven from transformers {release} on (installed: "
                    f"{installed('transformers')}); its tiny fixture is not built here")


def refused(error: type[BaseException], match: str, *, family: str | None = None, gap: str | None = None):
    """``pytest.raises(error, match=match)``, or, where the installed release is older than the ``family``'s proof
    or lacks the ``gap``, ``pytest.raises(UnsupportedVersionError)`` matching the version refusal naming it."""
    if gap is not None and not has(gap):
        release, what = GAPS[gap].since, ""
    elif family is not None and proven_from(family) is not None:
        release, what = proven_from(family), f"the {family} family is "
    else:
        return pytest.raises(error, match=match)
    named = re.escape(release)
    return pytest.raises(UnsupportedVersionError,
                         match=rf"{what}proven exact from transformers {named} on.*'transformers>={named}'")
