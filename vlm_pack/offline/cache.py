"""Tokenisation cache of ``prepare``, keyed on CONTENT, never on paths or modification times.

The key hashes (streamed, sha256) the input's bytes, the tokenizer's files (or, for a tokenizer object, its
serialised vocabulary, template and special tokens), the chat template in use, the fields, the template
choice and the length limit: everything that changes the tokens. A file edited and given back its old mtime
(``cp -p``, ``rsync -a``, ``tar``) gets a new key. A hit loads the tokenised split from flat ``.npy`` files
without importing transformers, torch or datasets, which is what makes a re-run nearly free.

Entries live in ``<cache_dir>/prepare/<key>/`` (default ``cache_dir``: ``$VLM_PACK_CACHE``, else
``$XDG_CACHE_HOME/vlm_pack``, else ``~/.cache/vlm_pack``), each written to a temporary folder and renamed
into place, so a killed run never leaves a half entry that a later run would trust.

Pack assignments are cached too (``<cache_dir>/prepare/packs/``), keyed on the sample lengths, the packing
settings and the source of the packing algorithms: a warm re-run then skips the packer's compiled loops (and
importing their compiler), yet any change to the lengths, the settings or the algorithms packs afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .encoding import TokenizedSplit
from .storage import FORMAT

CACHE_VERSION = f"{FORMAT}/tokens-2"
_ARRAYS = {"tokens": np.int32, "loss_mask": np.uint8, "offsets": np.int64, "source_index": np.int64}
# Files that cannot change how text becomes tokens: skipped when hashing a tokenizer (model) folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


def default_cache_dir() -> Path:
    if os.environ.get("VLM_PACK_CACHE"):
        return Path(os.environ["VLM_PACK_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_pack"


def hash_path(path: str | Path, h=None) -> "hashlib._Hash":
    """sha256 over a file's bytes, or over a folder's files (relative names + bytes, sorted), streamed."""
    h = h or hashlib.sha256()
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Content hash of a tokenizer: its folder's files (weights skipped), or a loaded object's definition."""
    h = hashlib.sha256()
    if isinstance(tokenizer, (str, Path)):
        folder = Path(tokenizer)
        for file in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)):
            h.update(file.name.encode("utf-8") + b"\0")
            hash_path(file, h)
        return "files:" + h.hexdigest()
    for part in (type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(),
                 repr(getattr(tokenizer, "chat_template", None)), repr(sorted(tokenizer.special_tokens_map.items()))):
        h.update(part.encode("utf-8") + b"\0")
    return "object:" + h.hexdigest()


def cache_key(input_path: str | Path, tokenizer_id: str, settings: dict) -> str:
    """Key of one tokenised split: input content + tokenizer content + every token-changing setting."""
    h = hash_path(input_path)
    h.update(json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer_id, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:40]


def _packing_code_hash() -> "hashlib._Hash":
    """sha256 over the source of the packing algorithms (their packs change when it does), to extend."""
    from . import algorithms

    return hash_path(Path(algorithms.__file__))


def packs_key(lengths: np.ndarray, pack_size: int, algorithm: str, seed: int, pad_seq_to_mult: int) -> str:
    """Key of one pack assignment: the lengths' bytes, the settings and the packing code itself."""
    h = _packing_code_hash()
    h.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    h.update(json.dumps([CACHE_VERSION, int(pack_size), algorithm, int(seed), int(pad_seq_to_mult)]).encode())
    return h.hexdigest()[:40]


def output_key(keys: dict[str, str], pack_size: int, **settings) -> str:
    """What one pack size's output is made of: the splits' token keys, the packing settings, the packing code and
    the file format. Written to the metadata; equal keys mean a re-run would write the very same files."""
    h = _packing_code_hash()
    h.update(json.dumps({"format": FORMAT, "tokens": keys, "pack_size": pack_size, **settings},
                        sort_keys=True).encode())
    return h.hexdigest()[:40]


class TokenCache:
    """Tokenised splits by key under ``<root>/prepare/``."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root if root is not None else default_cache_dir()) / "prepare"

    def load(self, key: str) -> tuple[TokenizedSplit, dict] | None:
        """The split and its info stored under ``key``, or None (absent or unreadable: treated as a miss)."""
        entry = self.root / key
        try:
            info = json.loads((entry / "info.json").read_text(encoding="utf-8"))
            # memory-mapped, read-only: a warm re-run copies each token once, straight into the packs
            arrays = {name: np.load(entry / f"{name}.npy", allow_pickle=False, mmap_mode="r") for name in _ARRAYS}
        except (OSError, ValueError):
            return None
        if any(arrays[name].dtype != dtype or arrays[name].ndim != 1 for name, dtype in _ARRAYS.items()):
            return None
        split = TokenizedSplit(arrays["tokens"], arrays["loss_mask"], arrays["offsets"], arrays["source_index"],
                               num_truncated=int(info["num_truncated"]), num_dropped=int(info["num_dropped"]))
        if len(split.offsets) != len(split.source_index) + 1 or split.offsets[-1] != len(split.tokens):
            return None
        return split, info

    def load_packs(self, key: str, count: int) -> np.ndarray | None:
        """Pack id of every sample stored under ``key`` (None when absent or not ``count`` int64 values)."""
        try:
            bins = np.load(self.root / "packs" / f"{key}.npy", allow_pickle=False)
        except (OSError, ValueError):
            return None
        return bins if bins.dtype == np.int64 and bins.shape == (count,) else None

    def store_packs(self, key: str, bins: np.ndarray) -> None:
        """Write a pack assignment atomically; skipped (not an error) when the cache cannot be written."""
        folder = self.root / "packs"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=folder)
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.asarray(bins, dtype=np.int64), allow_pickle=False)
            os.replace(tmp, folder / f"{key}.npy")
        except OSError:
            Path(locals().get("tmp", folder / ".none")).unlink(missing_ok=True)

    def store(self, key: str, split: TokenizedSplit, info: dict) -> None:
        """Write an entry atomically (a temporary folder renamed into place); a cache that cannot be written is
        skipped, never an error."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        except OSError:
            return
        try:
            for name, dtype in _ARRAYS.items():
                np.save(tmp / f"{name}.npy", np.asarray(getattr(split, name), dtype=dtype), allow_pickle=False)
            info = {**info, "num_truncated": split.num_truncated, "num_dropped": split.num_dropped}
            (tmp / "info.json").write_text(json.dumps(info, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.root / key)
        except OSError:
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
