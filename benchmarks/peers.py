"""Load peers' real packing functions at run time from a local git snapshot (never vendored into this repo).

Megatron-Bridge: ``pack_batch_sequences`` from ``src/megatron/bridge/training/vlm_step.py`` as it was before
the upstream refactor that moved in-batch packing to collate time (commit ``ebd55d7bc``, parent taken), and
today's ``build_mcore_thd_sequence_batch_from_rows`` / ``pack_right_padded_sequence_batch_to_mcore_thd`` from
``src/megatron/bridge/data/packing/in_batch.py``. Each function's source is read with ``git show``, cut out by
its AST node and executed with only ``torch`` (plus the constants it names) in scope, so Megatron itself is not
needed. Point ``--megatron-bridge`` at a clone or bare snapshot (default: ``$MEGATRON_BRIDGE_GIT`` or
``/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo``).
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_MB_GIT = os.environ.get("MEGATRON_BRIDGE_GIT", "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo")
VLM_STEP = ("ebd55d7bc^", "src/megatron/bridge/training/vlm_step.py")
IN_BATCH = ("HEAD", "src/megatron/bridge/data/packing/in_batch.py")


def _git_show(git_dir: str, rev: str, path: str) -> tuple[str, str]:
    """(source text, resolved commit) of ``path`` at ``rev``."""
    commit = subprocess.run(["git", "--git-dir", _git_dir(git_dir), "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    text = subprocess.run(["git", "--git-dir", _git_dir(git_dir), "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    return text, commit


def _git_dir(path: str) -> str:
    p = Path(path)
    return str(p / ".git") if (p / ".git").exists() else str(p)


def _functions(source: str, names: list[str], scope: dict) -> dict[str, Callable]:
    """Execute the named top-level functions of ``source`` (their exact text) in ``scope``."""
    tree = ast.parse(source)
    chunks = {node.name: ast.get_source_segment(source, node) for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in names}
    missing = set(names) - set(chunks)
    if missing:
        raise RuntimeError(f"functions {sorted(missing)} not found in the peer source")
    namespace = {"torch": torch, "__name__": "peer", **scope}
    exec("from __future__ import annotations\nfrom typing import Any\n"  # noqa: S102 - the peer's own code
         "from collections.abc import Mapping, MutableMapping, Sequence\n"
         + "\n\n".join(textwrap.dedent(chunks[n]) for n in names), namespace)
    return {name: namespace[name] for name in names}


def megatron_bridge(git_dir: str = DEFAULT_MB_GIT) -> tuple[dict[str, Callable], dict[str, str]]:
    """Megatron-Bridge's packers and the commits they came from; raises if the snapshot is unavailable."""
    vlm_source, vlm_commit = _git_show(git_dir, *VLM_STEP)
    fns = _functions(vlm_source, ["pack_batch_sequences"], {"logger": logging.getLogger("megatron_bridge_peer")})
    in_batch_source, in_batch_commit = _git_show(git_dir, *IN_BATCH)
    fns.update(_functions(in_batch_source, [
        "_ceil_to_multiple", "_token_key", "_set_tokens", "_right_padded_sequence_lengths",
        "_validate_sequence_tensor", "_validate_sequence_row_tensor", "build_mcore_thd_sequence_batch_from_rows",
        "pack_right_padded_sequence_batch_to_mcore_thd",
    ], {"IGNORE_INDEX": -100}))
    commits = {"vlm_step.py": f"{vlm_commit[:10]} ({VLM_STEP[1]})", "in_batch.py": f"{in_batch_commit[:10]} ({IN_BATCH[1]})"}
    return fns, commits
