"""Locked, atomic writes of one ``prepare`` run into ``<root>/packed/<tokenizer_name>/``.

Protocol (what the reader relies on):

1. Before tokenising: create the folder, take an exclusive lock on ``.vlm_pack.lock`` inside it (released by the
   OS when the process dies, even under SIGKILL; a second run fails naming the lock), refuse existing output
   without ``overwrite``, and create the run's temporary folder ``.prepare-*`` there (which proves the folder
   is writable). Temporary folders of dead runs are removed then.
   Output already made of the same content (the caller's ``current`` check) is kept as it is instead.
2. The run writes every file into its temporary folder; old output stays untouched and readable meanwhile.
3. Commit, once everything is written and flushed: remove the old pack indexes and metadata of the pack sizes
   being replaced, move the new companion files in, then each new pack index (``training_S.npy``: what the
   reader opens, so it goes last), then each metadata file.

A pack index therefore only ever sits next to the companion files written with it, and a killed or failed run
leaves either the old output, or no index (the reader refuses: "not found"), or new splits that are complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from .storage import SPLITS, metadata_path, sibling_paths, split_path

LOCK_NAME = ".vlm_pack.lock"
TMP_PREFIX = ".prepare-"


class OutputLockedError(OSError):
    """Another process is writing to the same output folder."""


class RunOutput:
    """Context manager: lock the output folder, hand out a temporary folder, commit its files on request."""

    def __init__(self, out_dir: str | Path, sizes: list[int], *, overwrite: bool,
                 current: Callable[[], Any] | None = None):
        """``current``: called under the lock; a non-None result means the existing output is already what this
        run would write: it is kept, ``self.current`` holds the result and nothing is staged."""
        self.out_dir = Path(out_dir)
        self.sizes = list(sizes)
        self.overwrite = overwrite
        self._current = current
        self.current = None
        self._lock = None
        self.tmp: Path | None = None

    def __enter__(self) -> "RunOutput":
        self._make_dir()
        self._take_lock()
        try:
            for stale in self.out_dir.glob(TMP_PREFIX + "*"):  # dead runs' leftovers (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            self.current = self._current() if self._current is not None else None
            if self.current is not None:
                return self
            self._check_existing()
            self.tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.out_dir))
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._release()

    def staged(self, final: Path) -> Path:
        """Where to write the file that will end up at ``final``."""
        return self.tmp / Path(final).name

    def commit(self) -> None:
        """Replace the old output of every pack size of this run with the staged files (see the module doc)."""
        staged = {p.name for p in self.tmp.iterdir()}
        for name in staged:
            _fsync(self.tmp / name)
        _fsync(self.tmp)
        for size in self.sizes:
            for split in SPLITS:
                split_path(self.out_dir, split, size).unlink(missing_ok=True)
            metadata_path(self.out_dir, size).unlink(missing_ok=True)
            for split in SPLITS:  # companions of a split this run does not write are orphans now
                for companion in sibling_paths(split_path(self.out_dir, split, size)).values():
                    if companion.name not in staged:
                        companion.unlink(missing_ok=True)
        indexes = {split_path(self.out_dir, split, size).name for split in SPLITS for size in self.sizes}
        metadata = {metadata_path(self.out_dir, size).name for size in self.sizes}
        for group in (staged - indexes - metadata, staged & indexes, staged & metadata):
            for name in sorted(group):
                os.replace(self.tmp / name, self.out_dir / name)
        _fsync(self.out_dir)

    def _make_dir(self) -> None:
        for parent in (self.out_dir, *self.out_dir.parents):
            if parent.exists():
                if not parent.is_dir():
                    raise NotADirectoryError(
                        f"output folder {self.out_dir}: {parent} is a file, not a folder; choose another --output-dir"
                    )
                break
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise PermissionError(
                f"cannot create the output folder {self.out_dir} (permission denied); choose a writable --output-dir"
            ) from None

    def _take_lock(self) -> None:
        import fcntl

        path = self.out_dir / LOCK_NAME
        try:
            handle = open(path, "a+")
        except PermissionError:
            raise PermissionError(
                f"cannot write to the output folder {self.out_dir} (permission denied); choose a writable --output-dir"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise OutputLockedError(
                f"{self.out_dir} is being written by another `vlm-pack prepare` (lock {path} held by pid {holder}); "
                "wait for it to finish, or write to another --output-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    def _check_existing(self) -> None:
        if self.overwrite:
            return
        existing = [p for size in self.sizes
                    for p in (*(split_path(self.out_dir, s, size) for s in SPLITS), metadata_path(self.out_dir, size))
                    if p.exists()]
        if existing:
            raise FileExistsError(
                f"{existing[0]} already exists ({len(existing)} output file(s) in {self.out_dir}); pass --overwrite "
                "(overwrite=True) to replace them, or choose another output directory"
            )


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (so a power loss cannot leave a renamed but empty file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
