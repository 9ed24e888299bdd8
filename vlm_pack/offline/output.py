"""Locked, atomic writes of one ``prepare`` run into ``<root>/packed/<tokenizer_name>/``.

Protocol (what the reader relies on):

1. Before tokenising: create the folder, take an exclusive lock on ``.vlm_pack.lock`` inside it (released by the
   OS when the process dies, even under SIGKILL; a second run fails naming the lock), refuse existing output
   without ``overwrite``, and create the run's temporary folder ``.prepare-*`` there (which proves the folder
   is writable). Temporary folders of dead runs are removed first, whatever the run goes on to do. A run that
   fails or is interrupted (Ctrl-C) removes its temporary folder, and the lock file and folders it created, before
   releasing the lock; a run that took the lock on a file removed meanwhile takes it again on the new one.
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
import stat
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
        self._created: list[Path] = []  # folders this run made (deepest first) and its lock file, if it made it

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
            self._remove_created()
            self._release()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if exc_type is not None:  # failed or interrupted (Ctrl-C): leave no empty folder or lock file of ours
            self._remove_created()
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
        missing = [p for p in (self.out_dir, *self.out_dir.parents) if not p.exists()]
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise PermissionError(
                f"cannot create the output folder {self.out_dir} (permission denied); choose a writable --output-dir"
            ) from None
        self._created.extend(missing)  # deepest first

    def _take_lock(self) -> None:
        import fcntl

        path = self.out_dir / LOCK_NAME
        for _ in range(3):
            made = not path.exists()
            try:  # never through a symlink; created here, or an earlier run's lock file (checked below)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except PermissionError:
                raise PermissionError(f"cannot write to the output folder {self.out_dir} (permission denied); "
                                      "choose a writable --output-dir") from None
            except OSError as err:  # ELOOP: a symlink
                raise OSError(f"lock file {path} cannot be opened ({err.strerror}): it is a symlink or not a regular "
                              "file; remove it") from None
            handle = os.fdopen(fd, "r+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = handle.read(64).strip() or "unknown"
                handle.close()
                raise OutputLockedError(
                    f"{self.out_dir} is being written by another `vlm-pack prepare` (lock {path} held by pid "
                    f"{holder}); wait for it to finish, or write to another --output-dir"
                ) from None
            if _same_file(handle, path):
                break
            handle.close()  # a failed run removed the lock file it made between our open and our lock: again
        else:
            raise OutputLockedError(f"{path} keeps being replaced by other runs; retry, or use another --output-dir")
        info = os.fstat(fd)
        content = handle.read(64)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size > 20 or not (
                content.isdigit() or content == ""):
            handle.close()
            raise OSError(f"lock file {path} is not one vlm_pack wrote (a hard link, or other content); remove it and "
                          "re-run")
        if made:
            self._created.insert(0, path)
        handle.seek(0)
        handle.truncate()  # only our own lock file: empty or a pid, one link
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle

    def _remove_created(self) -> None:
        """Remove the lock file and the folders this run created, while still holding the lock, folders only if
        empty (a run that waits on the lock file re-checks it after locking: see ``_take_lock``)."""
        for path in self._created:
            try:
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
            except OSError:  # not empty: another run's files (or ours the user must see); keep it and its parents
                break
        self._created = []

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


def _same_file(handle, path: Path) -> bool:
    """Whether ``path`` still names the open file ``handle`` (not removed, not replaced)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (so a power loss cannot leave a renamed but empty file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
