"""Offline packing input: read a data file or a saved ``datasets`` directory into records (:func:`read_input`).

JSONL (``.jsonl``, ``.ndjson``, a ``.json`` file of one object per line, or any other suffix) is read here, line
by line: every error names the file and the LINE of the file (blank lines count, so the number is what an editor
shows) and says how to fix it: bytes that are not UTF-8, malformed JSON, duplicate keys, nesting too deep for the
parser. A UTF-8 byte-order mark at the start of the file is accepted. Parquet, CSV / TSV, Arrow and JSON-array
files are read by ``datasets.load_dataset`` (its ``parquet`` / ``csv`` / ``arrow`` / ``json`` builders, into a
temporary cache, so nothing is left in the Hugging Face cache); a ``save_to_disk`` directory by
``datasets.load_from_disk``. Those name rows by their index (``row i``, from 0) instead.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOM = b"\xef\xbb\xbf"
# File suffix -> (``datasets.load_dataset`` builder, its keyword arguments); other files are read as JSONL.
TABLE_BUILDERS = {".parquet": ("parquet", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"sep": "\t"}),
                  ".arrow": ("arrow", {})}


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



def read_input(path: str | Path) -> dict[str, Records | None]:
    """``{"train": records}`` of a data file, or ``{"train": ..., "validation": ... or None}`` of a
    ``save_to_disk`` folder; the reader follows the suffix (module doc)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input {path} not found")
    if path.is_dir():
        train, validation = read_dataset_dir(path)
        return {"train": train, "validation": validation}
    suffix = path.suffix.lower()
    if suffix in TABLE_BUILDERS:
        return {"train": read_table(path, *TABLE_BUILDERS[suffix])}
    if suffix == ".json" and _first_byte(path) == b"[":
        return {"train": read_table(path, "json", {})}
    return {"train": read_jsonl(path)}


def _first_byte(path: Path) -> bytes:
    """The first non-blank byte of a file (after a byte-order mark): ``[`` for a JSON array."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    return head[:1]


def read_table(path: Path, builder: str, options: dict) -> Records:
    """Rows of a file ``datasets.load_dataset(builder, data_files=path)`` reads (parquet, CSV, Arrow, JSON)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="vlm_pack-read-") as cache:
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                           **options)
            rows = loaded.to_list()
            del loaded
    except Exception as err:  # pyarrow / pandas / datasets raise many types for a file they cannot parse
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: cannot read it as a {builder} file ({reason}); check the file, or convert it to "
                         "JSONL (one JSON object per line)") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not rows:
        raise ValueError(f"{path}: no records (the file has no rows); give a file with one sample per row")
    return Records(rows, str(path))
