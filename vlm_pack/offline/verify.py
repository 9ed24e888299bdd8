"""``vlm-pack verify DIR``: the full integrity check of packed data that opening skips to stay O(1).

For every ``<size>_metadata.jsonl`` in ``DIR`` and every split it lists: the O(1) open checks, then every
sample offset and pack record (monotonic, tiling), every loss-mask value (0/1), token and source index (>= 0),
every statistic of the metadata line recomputed from the packs (``max_samples_per_bin``, ``packing_factor``,
``packing_efficiency``, ``dataset_max_seqlen``, ``min_packed_seqlen``, counts), every pack's load (samples
aligned to ``pad_seq_to_mult``) against the pack size, and the sha256 of every file against the one recorded
at write time. Files are read in chunks (streamed), so
memory stays flat at any size. A pack index without metadata is reported too.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .storage import (
    FORMAT, metadata_path, open_packed, parse_split_path, read_metadata, sibling_paths, split_path,
)

CHUNK = 1 << 22  # elements per streamed check


@dataclass
class SplitReport:
    name: str
    problems: list[str] = field(default_factory=list)
    summary: str = ""


def find_packed_dir(directory: str | Path) -> Path:
    """``directory`` when it holds packed data, else the ONE packed folder below it (``directory`` is then the
    ``--output-dir`` of ``prepare``, with ``packed/<tokenizer-name>/`` inside, or its ``packed/``). Several
    packed folders below: a ValueError naming them; none: ``directory`` (reported as holding no packed data)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a folder; give the folder `vlm-pack prepare` wrote to "
                                "(<output-dir>/packed/<tokenizer-name>)")
    if _holds_packs(directory):
        return directory
    found = sorted({p for pattern in ("packed/*", "*") for p in directory.glob(pattern)
                    if p.is_dir() and _holds_packs(p)})
    if len(found) > 1:
        raise ValueError(f"{directory} holds {len(found)} packed folders ({', '.join(map(str, found))}); "
                         "give the one to verify")
    return found[0] if found else directory


def _holds_packs(directory: Path) -> bool:
    return any(directory.glob("*_metadata.jsonl")) or any(parse_split_path(p) for p in directory.glob("*.npy"))


def verify_packed(directory: str | Path) -> list[SplitReport]:
    """Check every split of a ``prepare`` output folder (or of the one below ``directory``: see
    :func:`find_packed_dir`); a report per split (no problems: verified)."""
    directory = find_packed_dir(directory)
    reports, covered = [], set()
    for meta in sorted(directory.glob("*_metadata.jsonl")):
        try:
            entries = read_metadata(meta)
        except ValueError as err:
            reports.append(SplitReport(meta.name, [str(err)]))
            continue
        for entry in entries:
            if entry.get("format") != FORMAT or entry.get("split") is None or entry.get("pack_size") is None:
                reports.append(SplitReport(meta.name, [f"{meta}: an entry has no split/pack_size of format {FORMAT}"]))
                continue
            index = split_path(directory, entry["split"], entry["pack_size"])
            covered.add(index.name)
            reports.append(_verify_split(index, entry))
    for index in sorted(directory.glob("*.npy")):
        if parse_split_path(index) and index.name not in covered:
            reports.append(SplitReport(index.stem, [f"{index}: no metadata line for it; re-run `vlm-pack prepare`"]))
    if not reports:
        reports.append(SplitReport(directory.name, [
            f"{directory}: no packed data (no *_metadata.jsonl here nor in {directory / 'packed'}/<tokenizer-name>/); "
            "give the folder `vlm-pack prepare` wrote: <output-dir>/packed/<tokenizer-name>"]))
    return reports


def _verify_split(index: Path, entry: dict) -> SplitReport:
    report = SplitReport(index.stem)
    try:
        arrays = open_packed(index).validate(str(index))
    except (OSError, ValueError) as err:
        report.problems.append(str(err))
        return report
    for name, array, ok in (
        ("loss_mask", arrays.loss_mask, lambda c: c.max(initial=0) <= 1),
        ("tokens", arrays.tokens, lambda c: c.min(initial=0) >= 0),
        ("source_index", arrays.source_index, lambda c: c.min(initial=0) >= -1),
    ):
        bad = next((start for start in range(0, len(array), CHUNK) if not ok(np.asarray(array[start:start + CHUNK]))),
                   None)
        if bad is not None:
            report.problems.append(f"{sibling_paths(index)[name]}: out-of-range values near element {bad}")
    report.problems.extend(_metadata_problems(arrays, entry, index))
    recorded = entry.get("files")
    if not recorded:
        report.problems.append(f"{index}: the metadata records no checksums (older writer); re-run prepare")
    else:
        for role, file in {"index": index, **sibling_paths(index)}.items():
            expected = recorded.get(role, {}).get("sha256")
            if expected != _sha256(file):
                report.problems.append(f"{file}: sha256 differs from the metadata; re-run `vlm-pack prepare`")
    report.summary = f"{arrays.num_packs} packs, {arrays.num_samples} samples, {len(arrays.tokens)} tokens"
    return report


def _metadata_problems(arrays, entry: dict, index: Path) -> list[str]:
    """Every statistic the metadata records, recomputed from the packs (an edited or stale line is named), and
    every pack's aligned load against the pack size."""
    from .algorithms import packing_stats
    from .prepare import _metadata_entry

    meta = metadata_path(index.parent, entry["pack_size"])
    lengths = arrays.sample_lengths()
    bin_ids = np.repeat(np.arange(arrays.num_packs), arrays.samples_per_pack())
    recomputed = _metadata_entry(packing_stats(lengths, bin_ids, entry["pack_size"]), arrays, entry["split"])
    problems = [f"{meta}: {entry['split']} field {name!r} is {entry.get(name)!r} but the packs give {value!r}; "
                "re-run `vlm-pack prepare`" for name, value in recomputed.items() if entry.get(name) != value]
    mult = entry.get("pad_seq_to_mult", 1)
    if not isinstance(mult, int) or isinstance(mult, bool) or mult < 1:
        problems.append(f"{meta}: {entry['split']} field 'pad_seq_to_mult' is {mult!r}, not an integer >= 1")
    elif arrays.num_packs:
        loads = arrays.pack_loads(mult)
        if loads.max() > entry["pack_size"]:
            k = int(np.argmax(loads))
            problems.append(f"{index}: pack {k} fills {int(loads[k])} slots with samples aligned to {mult}, more than "
                            f"the pack size {entry['pack_size']}; re-run `vlm-pack prepare`")
    return problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="check packed data completely: structure, values and the checksums recorded at write time",
        description="Streamed full check of a `vlm-pack prepare` output folder (<output-dir>/packed/<tokenizer-name>). "
                    "Exit code 0: every split verified; 1: problems (listed).",
    )
    p.add_argument("directory", help="the folder holding training_<size>.npy and <size>_metadata.jsonl, or the "
                                     "--output-dir of `prepare` when it holds one such folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = find_packed_dir(args.directory)
    if directory != Path(args.directory):
        print(f"verifying {directory}")
    failed = 0
    for report in verify_packed(directory):
        if report.problems:
            failed += 1
            for problem in report.problems:
                print(f"FAIL {report.name}: {problem}")
        else:
            print(f"ok   {report.name}: {report.summary}, checksums match")
    return 1 if failed else 0
