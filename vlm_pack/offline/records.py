"""Offline packing input: read a JSONL file or a saved ``datasets`` directory into checked records.

Every error names the file and the LINE of the file (blank lines count, so the number is what an editor
shows) and says how to fix it: bytes that are not UTF-8, malformed JSON, duplicate keys, nesting too deep
for the parser. A UTF-8 byte-order mark at the start of the file is accepted. A ``save_to_disk`` directory
names rows by their index instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOM = b"\xef\xbb\xbf"


@dataclass
class Records:
    """Rows of one input split and where each came from (file lines, or row indices for a dataset)."""

    rows: list[dict]
    source: str
    lines: list[int] | None = None  # 1-based file line of every row (JSONL); None: rows are dataset rows

    def where(self, i: int) -> str:
        """``"<file>, line N"`` (JSONL) or ``"<dir>, row i"`` (dataset): how errors name row ``i``."""
        return f"{self.source}, line {self.lines[i]}" if self.lines is not None else f"{self.source}, row {i}"

    def __len__(self) -> int:
        return len(self.rows)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` hook: a key given twice is an error (plain ``json`` keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def parse_line(raw: bytes, where: str) -> Any:
    """One JSONL line (bytes, without BOM) -> its JSON value; ValueError naming ``where`` and the fix."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); re-encode the "
            "file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise ValueError(f"{where}: duplicate key {err.args[0]!r} in one JSON object; keep only one of them") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: malformed JSON ({err.msg} at column {err.colno}); fix or remove the line") from None
    except RecursionError:
        raise ValueError(
            f"{where}: JSON nested too deeply for the parser; flatten the record (a sample needs a few levels)"
        ) from None


def read_jsonl(path: str | Path, *, progress: bool = False) -> Records:
    """Read every non-blank line of a JSONL file as one record."""
    from tqdm.auto import tqdm

    path = Path(path)
    rows, lines = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(tqdm(f, desc=f"reading {path.name}", unit=" lines", disable=not progress), 1):
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            rows.append(parse_line(raw, f"{path}, line {number}"))
            lines.append(number)
    if not rows:
        raise ValueError(f"{path}: no records (the file is empty); give a JSONL file with one sample per line")
    return Records(rows, str(path), lines)


def read_dataset_dir(path: str | Path) -> tuple[Records, Records | None]:
    """A ``save_to_disk`` directory: a Dataset, or a DatasetDict with ``train`` (+ ``validation``)."""
    import datasets

    path = Path(path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(
            f"{path} is a folder but not a dataset saved with `save_to_disk` ({err}); give a JSONL file or such a "
            "folder"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        train_key = next((k for k in ("train", "training") if k in loaded), None)
        if train_key is None:
            raise ValueError(f"{path}: DatasetDict has splits {list(loaded)}; expected 'train' (and 'validation')")
        validation = loaded.get("validation")
        return (Records(loaded[train_key].to_list(), f"{path} [{train_key}]"),
                None if validation is None else Records(validation.to_list(), f"{path} [validation]"))
    return Records(loaded.to_list(), str(path)), None

