"""Tokenisation cache of ``prepare``, keyed on CONTENT, never on paths or modification times.

The key hashes (streamed, sha256) the input's bytes, the tokenizer's files (or, for a tokenizer object, its
serialised vocabulary, template and special tokens), the chat template in use, the fields, the template
choice and the length limit: everything that changes the tokens. A file edited and given back its old mtime
(``cp -p``, ``rsync -a``, ``tar``) gets a new key. A hit loads the tokenised split from flat ``.npy`` files
without importing transformers, torch or datasets, which is what makes a re-run nearly free.

Entries live in ``<cache_dir>/prepare/<key>/`` (default ``cache_dir``: ``$VLM_PACK_CACHE``, else
``$XDG_CACHE_HOME/vlm_pack``, else ``~/.cache/vlm_pack``), each written to a temporary folder and renamed
into place, so a killed run never leaves a half entry that a later run would trust.

Every entry records the sha256 of its files, checked on each use: a corrupted entry (a flipped byte, a zeroed
file, an edited ``info.json``) is named in the log and rebuilt, never packed. Pack assignments are also checked
to be a valid packing of the current lengths.

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
from typing import Any, Callable

import numpy as np

from .encoding import TokenizedSplit
from .storage import FORMAT

CACHE_VERSION = f"{FORMAT}/tokens-3"  # 3: entries carry the sha256 of their arrays
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


def _atomic_write(path: Path, content: bytes | Callable[[Any], None]) -> None:
    """Write ``content`` (bytes, or a writer of an open binary file) to a temporary file renamed onto ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            content(f) if callable(content) else f.write(content)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


class TokenCache:
    """Tokenised splits by key under ``<root>/prepare/``."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root if root is not None else default_cache_dir()) / "prepare"

    def load(self, key: str, log: Callable[[str], None] = print) -> tuple[TokenizedSplit, dict] | None:
        """The split and its info stored under ``key``, or None: absent, or unreadable, incomplete or not matching
        the sha256 recorded at write time (then ``log`` names the file and the entry is rebuilt by the caller)."""
        entry = self.root / key
        if not entry.is_dir():
            return None
        try:
            info = json.loads((entry / "info.json").read_text(encoding="utf-8"))
            sums = info["sha256"]
            for name in _ARRAYS:
                if hash_path(entry / f"{name}.npy").hexdigest() != sums[name]:
                    raise ValueError(f"{entry / name}.npy: sha256 differs from the one in info.json")
            # memory-mapped, read-only: a warm re-run copies each token once, straight into the packs
            arrays = {name: np.load(entry / f"{name}.npy", allow_pickle=False, mmap_mode="r") for name in _ARRAYS}
            if any(arrays[name].dtype != dtype or arrays[name].ndim != 1 for name, dtype in _ARRAYS.items()):
                raise ValueError(f"{entry}: an array has the wrong dtype or shape")
            split = TokenizedSplit(arrays["tokens"], arrays["loss_mask"], arrays["offsets"], arrays["source_index"],
                                   num_truncated=int(info["num_truncated"]), num_dropped=int(info["num_dropped"]))
            offsets = np.asarray(split.offsets)
            if (len(offsets) != len(split.source_index) + 1 or offsets[0] != 0 or offsets[-1] != len(split.tokens)
                    or np.any(np.diff(offsets) <= 0)):
                raise ValueError(f"{entry / 'offsets.npy'}: offsets do not tile the tokens")
            if not isinstance(info.get("template"), str):
                raise KeyError(f"{entry / 'info.json'} has no template")
        except (OSError, ValueError, KeyError, TypeError) as err:
            log(f"token cache entry {entry} is unusable ({type(err).__name__}: {err}); tokenising again")
            return None
        return split, info

    def load_packs(self, key: str, lengths: np.ndarray, pack_size: int,
                   log: Callable[[str], None] = print) -> np.ndarray | None:
        """Pack id of every sample stored under ``key``, or None: absent, or (``log`` names the file) not
        matching its recorded sha256, or not a valid packing of ``lengths`` into ``pack_size`` (ids 0..n-1, none
        empty, no pack over the size)."""
        path = self.root / "packs" / f"{key}.npy"
        if not path.exists():
            return None
        try:
            bins = np.load(path, allow_pickle=False)
            recorded = path.with_suffix(".sha256").read_text(encoding="ascii").strip()
            ok = (bins.dtype == np.int64 and bins.shape == lengths.shape
                  and hashlib.sha256(bins.tobytes()).hexdigest() == recorded)
            if ok and len(bins):
                counts = np.bincount(bins, minlength=1) if bins.min() >= 0 else np.zeros(1)
                ok = bool(counts.all()) and np.bincount(bins, weights=lengths).max() <= pack_size
        except (OSError, ValueError):
            ok = False
        if not ok:
            log(f"pack-assignment cache {path} is corrupt (sha256 or packing check failed); packing again")
            return None
        return bins

    def store_packs(self, key: str, bins: np.ndarray) -> None:
        """Write a pack assignment and its sha256 atomically; skipped (not an error) when the cache cannot be
        written."""
        folder = self.root / "packs"
        bins = np.ascontiguousarray(bins, dtype=np.int64)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / f"{key}.sha256", hashlib.sha256(bins.tobytes()).hexdigest().encode())
            _atomic_write(folder / f"{key}.npy", lambda f: np.save(f, bins, allow_pickle=False))
        except OSError:
            pass

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
            sums = {name: hash_path(tmp / f"{name}.npy").hexdigest() for name in _ARRAYS}
            info = {**info, "num_truncated": split.num_truncated, "num_dropped": split.num_dropped, "sha256": sums}
            (tmp / "info.json").write_text(json.dumps(info, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.root / key)
        except OSError:
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
