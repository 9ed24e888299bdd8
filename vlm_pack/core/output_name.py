"""The one rule for a user-given output folder name (no torch: ``vlm-pack prepare`` on a warm cache imports it)."""

from __future__ import annotations

from pathlib import Path


def check_output_name(name: str, where: str) -> str:
    """``name`` as one plain folder name, so ``<root>/packed/<name>`` stays inside ``<root>/packed`` (no ``/``,
    ``\\``, ``..``, absolute path or empty name); ``where`` names the option or field in the error."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
            or Path(name).is_absolute()):
        raise ValueError(f"{where}={name!r} must be a plain folder name (no '/', '\\' or '..'): it names the "
                         "sub-folder packed/<name>/ of the output folder; give e.g. the tokenizer's name")
    return name
