"""One module ``__getattr__`` for the packages that export names from their submodules lazily: importing a
package (``vlm-pack --help``, ``import vlm_pack``) must not load torch until a name is used."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_getattr(package: str, names: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """``__getattr__`` for ``package``: ``names`` maps an exported name to its submodule (relative to the package);
    the value is imported on first use and cached in the package's ``namespace``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(import_module(f".{names[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
