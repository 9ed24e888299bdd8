"""The offline pipeline's compiled loops: plain Python functions compiled by numba on first use.

numba is a dependency, imported only when a loop first runs (``vlm-pack`` start-up stays light); the machine
code is cached on disk next to the module, so later processes load it instead of compiling (~1-6 s once).
"""

from __future__ import annotations

import functools


@functools.cache
def compiled(loop):
    """``loop`` compiled in nopython mode (no GIL held while it runs), cached in memory and on disk."""
    try:
        import numba
    except ImportError as exc:  # a dependency of vlm_pack; only a broken install gets here
        raise ImportError("vlm_pack's offline packing needs numba: pip install numba") from exc
    return numba.njit(cache=True, nogil=True)(loop)
