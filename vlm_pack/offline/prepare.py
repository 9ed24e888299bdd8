"""Offline packing, step 1: tokenise an SFT dataset once, bin-pack it, write packs + metadata to disk.

Input: any file ``datasets.load_dataset`` reads (JSONL, JSON, parquet, CSV, Arrow) or a local ``datasets``
directory (``save_to_disk``), in one of TRL's dataset formats (conversational ``messages``, prompt-completion as
strings or as message lists, ``text``) or alpaca prompt/response, detected from the first record (field names
configurable). Formats and label masks: :mod:`.encoding` (chat labels come from the template's assistant spans,
never from searching the reply's text). Reading and line/row-numbered errors: :mod:`.records`.

Re-runs: tokenised splits are cached under a key of the input's CONTENT and every token-changing setting
(:mod:`.cache`); a hit skips transformers entirely, so a re-run costs the hashing, packing and writing.

Writes: locked and atomic (:mod:`.output`): the output folder is locked and checked writable before any
tokenising, every file goes to a temporary folder first, and the old output stays readable until the new one is
complete. A failed or killed run leaves no output the reader accepts that differs from an uninterrupted run.

Lengths: with ``max_seq_length`` a longer sample keeps its first ``max_seq_length`` tokens (counted as
``num_truncated``); a sample whose whole response was cut off is dropped (``num_dropped``). Without it, a sample
longer than the pack size is an error naming the sample. ``pad_seq_to_mult`` packs on lengths rounded up to
that multiple, so the collate-time alignment padding always fits (tokens are stored unpadded).

Validation: ``validation_path`` (a second file) or ``validation_fraction`` of the training rows (a seeded random
subset, taken after tokenisation, so ``source_index`` always points at the input row); neither: training only.

Output per pack size ``S`` (see ``storage.py`` for the files): ``<root>/packed/<tokenizer_name>/training_S.npy``,
``validation_S.npy`` and ``S_metadata.jsonl`` (one line per split: ``max_samples_per_bin``,
``dataset_max_seqlen``, ``min_packed_seqlen``, ``packing_factor``, ``packing_efficiency``, ``pack_size``,
``num_packs``, ``num_samples``, ``num_tokens``, ``algorithm``, ``seed``, ``pad_seq_to_mult``, ``files`` (bytes and
sha256 of every file), ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..data.chat_template import RENDERING_RULE
from .algorithms import ALGORITHMS, PackingStats, check_seed, group_by_pack, pack_lengths, packing_stats
from .cache import TokenCache, cache_key, output_key, packs_key, tokenizer_fingerprint
from .encoding import (
    ALPACA_PROMPT,
    FORMATS_RULE,
    TEMPLATES,
    SampleEncoder,
    SampleFormat,
    TokenizedSplit,
    check_records,
    tokenize_records,
)
from ..core.output_name import check_output_name
from .output import RunOutput
from .records import Records, read_input
from .storage import (
    FORMAT,
    PackedArrays,
    build_index,
    file_checksums,
    metadata_path,
    open_packed,
    read_metadata,
    split_path,
    write_metadata,
    write_packed,
)

__all__ = ["ALPACA_PROMPT", "TEMPLATES", "PrepareOptions", "PreparedSplit", "prepare_packed_sequence_data",
           "tokenized_splits"]


@dataclass
class PreparedSplit:
    """One written split at one pack size."""

    split: str
    pack_size: int
    path: Path
    metadata: dict


class TokenizerSource:
    """The tokenizer as given (local folder or object), loaded only when a cache miss needs it."""

    def __init__(self, tokenizer: str | Path | Any):
        if isinstance(tokenizer, (str, Path)):
            folder = Path(tokenizer)
            if not folder.is_dir():
                state = "is a file" if folder.exists() else "does not exist"
                raise FileNotFoundError(
                    f"tokenizer {folder} {state}; give a local tokenizer folder (the one holding tokenizer.json and "
                    "tokenizer_config.json; download a hub tokenizer once with `hf download NAME --local-dir DIR`)"
                )
            self._object, self.path = None, folder
        else:
            self._object, self.path = tokenizer, None
        self.fingerprint = tokenizer_fingerprint(self.path or tokenizer)

    @property
    def name(self) -> str:
        if self.path is not None:
            return self.path.resolve().name
        return Path(getattr(self._object, "name_or_path", "") or "tokenizer").name

    def load(self):
        if self._object is None:
            self._object = _LOADED.get(self.fingerprint) or self._from_folder()
            _LOADED.clear()  # keep only the latest: a loaded tokenizer holds tens of MB
            _LOADED[self.fingerprint] = self._object
        return self._object

    def _from_folder(self):
        from transformers import AutoTokenizer

        try:  # local files only: a folder never needs the network, so never wait for one
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:  # transformers raises many types for a folder it cannot read
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"tokenizer {self.path}: cannot load it ({reason}); give a folder with tokenizer.json and "
                "tokenizer_config.json"
            ) from None


_LOADED: dict[str, Any] = {}  # content fingerprint -> tokenizer loaded from a folder (re-runs in one process)


def tokenized_splits(
    train_path: str | Path, tokenizer: TokenizerSource, fmt: SampleFormat, *, validation_path: str | Path | None = None,
    max_seq_length: int | None = None, chat_template: str | None = None, cache_dir: str | Path | None = None,
    num_proc: int = 1, progress: bool = False, log: Callable[[str], None] = print, keys: dict[str, str] | None = None,
) -> tuple[dict[str, TokenizedSplit], str]:
    """``{"training": ..., ["validation": ...]}`` tokenised (from the cache when the content was seen) and the
    resolved template name. ``keys``: the splits' :func:`token_keys`, when the caller computed them already."""
    cache = TokenCache(cache_dir)
    parts = _parts(train_path, validation_path)
    keys = keys or token_keys(train_path, tokenizer, fmt, validation_path=validation_path,
                              max_seq_length=max_seq_length, chat_template=chat_template)
    splits, template = {}, fmt.template
    for split, path, part in parts:
        if split in splits:  # filled while tokenising the other split of the same folder
            continue
        hit = cache.load(keys[split], log)
        if hit is not None:
            result, info = hit
            template = info["template"]
            if not info.get("absent"):
                log(f"{split}: tokenised samples from the cache ({cache.root / keys[split]})")
                splits[split] = result
            continue
        for other_part, records in read_input(path).items():  # a folder's other split is cached on the way
            other = next((s for s, p, q in parts if p == path and q == other_part), None)
            if other is None or other in splits:
                continue
            result, template = _tokenize(records, tokenizer, fmt, max_seq_length, chat_template, num_proc,
                                         progress, log)
            info = {"template": template, "absent": result is None, "source": str(path), "part": other_part}
            cache.store(keys[other], result if result is not None else _EMPTY, info)
            if result is not None:
                splits[other] = result
    return {s: splits[s] for s in ("training", "validation") if s in splits}, template


def _parts(train_path: str | Path, validation_path: str | Path | None) -> list[tuple[str, Path, str]]:
    """(split, input path, part of that input) for every split the input can hold."""
    parts = [("training", Path(train_path), "train")]
    if validation_path is not None:
        parts.append(("validation", Path(validation_path), "train"))
    elif Path(train_path).is_dir():
        parts.append(("validation", Path(train_path), "validation"))  # a DatasetDict's own split, if it has one
    return parts


def token_keys(train_path: str | Path, tokenizer: TokenizerSource, fmt: SampleFormat, *,
               validation_path: str | Path | None = None, max_seq_length: int | None = None,
               chat_template: str | None = None) -> dict[str, str]:
    """Cache key of every split's tokens: the input's bytes, the tokenizer's files, every token-changing setting."""
    settings = {"template": fmt.template, "prompt_field": fmt.prompt_field, "response_field": fmt.response_field,
                "messages_field": fmt.messages_field, "completion_field": fmt.completion_field,
                "text_field": fmt.text_field, "formats_rule": FORMATS_RULE, "max_seq_length": max_seq_length,
                "chat_template": chat_template, "rendering_rule": RENDERING_RULE}
    return {split: cache_key(path, tokenizer.fingerprint, {**settings, "part": part})
            for split, path, part in _parts(train_path, validation_path)}


def current_output(out_dir: Path, keys_by_size: dict[int, str]) -> list[PreparedSplit] | None:
    """The existing output when every pack size's metadata carries the expected :func:`output_key` and every
    file still has the size and sha256 recorded there; None otherwise (absent, older, other settings, edited)."""
    found = []
    try:
        for size, key in keys_by_size.items():
            entries = read_metadata(metadata_path(out_dir, size))
            if not entries or any(entry.get("output_key") != key for entry in entries):
                return None
            for entry in entries:
                final = split_path(out_dir, entry["split"], size)
                if file_checksums(final) != entry.get("files"):
                    return None
                found.append(PreparedSplit(entry["split"], size, final, entry))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found


_EMPTY = TokenizedSplit(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64), np.zeros(0, np.int64))


def _tokenize(records: Records | None, tokenizer: TokenizerSource, fmt: SampleFormat, max_seq_length, chat_template,
              num_proc, progress, log) -> tuple[TokenizedSplit | None, str]:
    if records is None:
        return None, fmt.template
    if not len(records):
        raise ValueError(f"{records.source}: no records")
    resolved = check_records(records, fmt)
    encoder = SampleEncoder(tokenizer.load(), resolved, max_seq_length, chat_template)
    return tokenize_records(records, encoder, num_proc=num_proc, log=log, progress=progress), resolved.template


def pack_split(samples: TokenizedSplit, pack_size: int, *, algorithm: str = "best_fit_decreasing", seed: int = 0,
               pad_seq_to_mult: int = 1, split: str = "training", cache: TokenCache | None = None,
               log: Callable[[str], None] = print) -> tuple[PackedArrays, PackingStats]:
    """Bin-pack one tokenised split; returns the arrays to write (samples regrouped pack by pack) and stats.

    With ``cache``, the pack assignment is reused when the lengths and settings were packed before."""
    lengths = samples.lengths
    padded = -(-lengths // pad_seq_to_mult) * pad_seq_to_mult
    too_long = np.flatnonzero(padded > pack_size)
    if too_long.size:
        i = int(too_long[0])
        aligned = f" (padded to {padded[i]} for pad_seq_to_mult={pad_seq_to_mult})" if pad_seq_to_mult > 1 else ""
        raise ValueError(
            f"{split} sample {i} (input row {samples.source_index[i]}) has {lengths[i]} tokens{aligned}, more than "
            f"the pack size {pack_size} ({too_long.size} such samples); set max_seq_length <= {pack_size} "
            "(--max-seq-length) to truncate them, or raise the pack size"
        )
    key = packs_key(padded, pack_size, algorithm, seed, pad_seq_to_mult) if cache is not None else None
    bin_ids = cache.load_packs(key, padded, pack_size, log) if cache is not None else None
    if bin_ids is None:
        bin_ids = pack_lengths(padded, pack_size, algorithm, seed)
        if cache is not None:
            cache.store_packs(key, bin_ids)
    order, pack_offsets = group_by_pack(bin_ids)
    regrouped = samples.take(order)
    arrays = PackedArrays(
        index=build_index(np.diff(pack_offsets), regrouped.offsets),
        tokens=regrouped.tokens,
        loss_mask=regrouped.loss_mask,
        seq_offsets=regrouped.offsets,
        source_index=regrouped.source_index,
    )
    return arrays, packing_stats(lengths, bin_ids, pack_size)


@dataclass(frozen=True)
class PrepareOptions:
    """How :func:`prepare_packed_sequence_data` reads, tokenises, packs and writes (every keyword it takes; what the
    ``vlm-pack prepare`` flags set). Checked when built, so the CLI and the API refuse the same values."""

    validation_path: str | Path | None = None
    """Validation data (same formats as the input); or ``validation_fraction`` of the training rows (a seeded
    random subset, taken after tokenisation), not both."""
    validation_fraction: float = 0.0
    template: str = "auto"
    """``auto`` (detected from the first record: TRL's conversational ``messages``, prompt-completion or ``text``
    formats, or alpaca prompt/response; :mod:`.encoding`), or one of ``chat``, ``prompt_completion``, ``text``,
    ``alpaca``; the ``*_field`` options name the fields."""
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    completion_field: str = "completion"
    text_field: str = "text"
    chat_template: str | None = None
    """Jinja text that replaces the tokenizer's own template for chats."""
    max_seq_length: int | None = None
    """Longer samples keep their first ``max_seq_length`` tokens (a sample whose whole response is cut off is
    dropped); without it a sample longer than the pack size is an error naming it."""
    algorithm: str = "best_fit_decreasing"
    seed: int = 0
    pad_seq_to_mult: int = 1
    """Pack on lengths rounded up to this multiple (the collate-time alignment padding then always fits)."""
    num_proc: int = 1
    global_batch_size: int | None = None
    """Samples per optimizer step: the summary then says how many packs per step keep it."""
    tokenizer_name: str | None = None
    """Names the output folder ``<output_root>/packed/<name>`` (default: the tokenizer folder's name)."""
    overwrite: bool = False
    """Replace existing output (else an error)."""
    cache_dir: str | None = None
    """Where tokenised splits are cached (:mod:`.cache`)."""
    allow_pickle: bool = False
    """Read a ``.npy`` input (already-packed data in the reference pickle format; trusted files only)."""
    progress: bool = True
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown packing algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if self.max_seq_length is not None:
            _positive_int(self.max_seq_length, "max_seq_length (--max-seq-length)")
        _positive_int(self.pad_seq_to_mult, "pad_seq_to_mult (--pad-seq-to-mult)")
        check_seed(self.seed, "seed (--seed)")
        _positive_int(self.num_proc, "num_proc (--num-proc)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.validation_path is not None and self.validation_fraction:
            raise ValueError("give either validation_path or validation_fraction, not both")
        if self.tokenizer_name is not None:
            check_output_name(self.tokenizer_name, "tokenizer_name (--tokenizer-name)")


def prepare_packed_sequence_data(
    train_path: str | Path,
    tokenizer: str | Path | Any,
    output_root: str | Path,
    pack_sizes: int | list[int],
    options: PrepareOptions | None = None,
    **overrides: Any,
) -> list[PreparedSplit]:
    """Tokenise, pack and write a dataset for every pack size; returns what was written.

    Prints, per pack size, the packing factor ``n``, the efficiency and, with ``global_batch_size``, how many packs
    per step keep the same samples per step. A ``.npy`` input is taken as already-packed data in the reference
    pickle format and converted as is (packs unchanged, one pack size; needs ``allow_pickle=True``).

    Args:
        train_path: the training data: a JSONL, JSON, parquet, CSV or Arrow file, a ``save_to_disk`` directory, or
            a reference ``.npy``.
        tokenizer: a local folder (loaded with ``AutoTokenizer``, local files only) or a tokenizer object.
        output_root: packs go to ``<output_root>/packed/<tokenizer_name>/``.
        pack_sizes: one or more pack sizes in tokens.
        options: a :class:`PrepareOptions` (what ``vlm-pack prepare`` builds from its flags).
        **overrides: any :class:`PrepareOptions` field by name, replacing ``options``' (e.g.
            ``prepare_packed_sequence_data(path, tok, out, [2048], tokenizer_name="t", overwrite=True)``).

    Returns:
        One :class:`PreparedSplit` per split and pack size. Existing output is an error unless ``overwrite``; output
        already made of the same content and settings is kept as it is (and returned).
    """
    opts = replace(options or PrepareOptions(), **overrides)
    sizes = sorted({_positive_int(s, "pack size") for s in ([pack_sizes] if _is_int(pack_sizes) else pack_sizes)})
    if not sizes:
        raise ValueError("give at least one pack size")
    validation_path, validation_fraction, seed = opts.validation_path, opts.validation_fraction, opts.seed
    max_seq_length, chat_template, algorithm = opts.max_seq_length, opts.chat_template, opts.algorithm
    pad_seq_to_mult, tokenizer_name, overwrite = opts.pad_seq_to_mult, opts.tokenizer_name, opts.overwrite
    log = opts.log
    for source in (train_path, validation_path):
        if source is not None and not Path(source).exists():
            raise FileNotFoundError(f"input {source} not found; check the path (--input / --validation)")
    fmt = SampleFormat(opts.template, opts.prompt_field, opts.response_field, opts.messages_field,
                       opts.completion_field, opts.text_field)
    if Path(train_path).suffix == ".npy":
        out_dir = Path(output_root) / "packed" / (tokenizer_name or _plain_name(tokenizer))
        inputs = {"training": train_path, "validation": validation_path}
        return _convert_reference(inputs, out_dir, sizes, allow_pickle=opts.allow_pickle, overwrite=overwrite, log=log)
    source = TokenizerSource(tokenizer)
    out_dir = Path(output_root) / "packed" / (tokenizer_name or source.name)

    keys = token_keys(train_path, source, fmt, validation_path=validation_path, max_seq_length=max_seq_length,
                      chat_template=chat_template)
    output_keys = {size: output_key(keys, size, algorithm=algorithm, seed=seed, pad_seq_to_mult=pad_seq_to_mult,
                                    validation_fraction=validation_fraction, tokenizer_name=out_dir.name)
                   for size in sizes}
    # locked and writable before any tokenising; output already made of the same content is kept as it is
    with RunOutput(out_dir, sizes, overwrite=overwrite, current=lambda: current_output(out_dir, output_keys)) as run:
        if run.current is not None:
            for split in run.current:
                log(summary_line(split.metadata, opts.global_batch_size))
            log(f"{out_dir} is up to date (same input content, tokenizer, settings and packing code; checksums "
                "match): nothing written")
            return run.current
        splits, template = tokenized_splits(
            train_path, source, fmt, validation_path=validation_path, max_seq_length=max_seq_length,
            chat_template=chat_template, cache_dir=opts.cache_dir, num_proc=opts.num_proc, progress=opts.progress,
            log=log,
            keys=keys)
        if "validation" not in splits and validation_fraction:
            splits["training"], splits["validation"] = _split_off(splits["training"], validation_fraction, seed)
        written = []
        for size in sizes:
            entries = []
            for split, samples in splits.items():
                if len(samples.source_index) == 0:
                    raise ValueError(f"the {split} split has no sample left to pack (all were dropped)")
                arrays, stats = pack_split(samples, size, algorithm=algorithm, seed=seed,
                                           pad_seq_to_mult=pad_seq_to_mult, split=split,
                                           cache=TokenCache(opts.cache_dir),
                                           log=log)
                final = split_path(out_dir, split, size)
                staged = write_packed(run.staged(final), arrays)
                entry = _metadata_entry(
                    stats, arrays, split, algorithm=algorithm, seed=seed, pad_seq_to_mult=pad_seq_to_mult,
                    max_seq_length=max_seq_length, template=template, tokenizer=out_dir.name,
                    output_key=output_keys[size],
                    num_truncated=samples.num_truncated, num_dropped=samples.num_dropped,
                    files=file_checksums(staged),
                )
                entries.append(entry)
                written.append(PreparedSplit(split, size, final, entry))
                log(summary_line(entry, opts.global_batch_size))
            write_metadata(run.staged(metadata_path(out_dir, size)), entries)
        run.commit()
    log(f"wrote {len(written)} packed split(s) to {out_dir}")
    return written


def summary_line(entry: dict, global_batch_size: int | None = None) -> str:
    """One human line per split and pack size: n, efficiency and, for a GBS, the packs per step to use."""
    n = entry["packing_factor"]
    line = (
        f"pack size {entry['pack_size']} ({entry['split']}): {entry['num_samples']} samples -> {entry['num_packs']} "
        f"packs, n = {n:.2f} samples/pack, efficiency {entry['packing_efficiency']:.2f}%, "
        f"max {entry['max_samples_per_bin']} samples/pack"
    )
    if entry["num_truncated"] or entry["num_dropped"]:
        line += f", {entry['num_truncated']} truncated, {entry['num_dropped']} dropped"
    if global_batch_size:
        line += (f"; global batch size {global_batch_size} samples -> use GBS / n = "
                 f"{global_batch_size / n:.2f} ~ {max(1, round(global_batch_size / n))} packs per step")
    return line


def _convert_reference(inputs: dict, out_dir: Path, sizes: list[int], *, allow_pickle: bool, overwrite: bool,
                       log: Callable[[str], None]) -> list[PreparedSplit]:
    """Rewrite reference ``.npy``-of-dicts packs (pickle, opt-in) in our format, keeping every pack as it is."""
    if len(sizes) != 1:
        raise ValueError(
            f"converting already-packed .npy data needs exactly one pack size (the one it was packed to), got {sizes}"
        )
    size = sizes[0]
    if not allow_pickle:  # refuse before touching the file
        raise ValueError(
            f"{inputs['training']} is a .npy file, i.e. already-packed data in the reference pickle format: reading it "
            "runs pickle, which can execute code from the file. Pass --allow-pickle (allow_pickle=True) only if you "
            "trust it"
        )
    written, entries = [], []
    with RunOutput(out_dir, sizes, overwrite=overwrite) as run:
        for split, source in inputs.items():
            if source is None:
                continue
            arrays = open_packed(source, allow_pickle=True)
            lengths = arrays.sample_lengths()
            loads = arrays.pack_loads()
            if len(loads) and loads.max() > size:
                i = int(np.argmax(loads))
                raise ValueError(
                    f"{source}: pack {i} holds {loads[i]} tokens, more than the pack size {size}; pass the size it "
                    "was packed to"
                )
            stats = packing_stats(lengths, np.repeat(np.arange(arrays.num_packs), arrays.samples_per_pack()), size)
            final = split_path(out_dir, split, size)
            staged = write_packed(run.staged(final), arrays)
            entry = _metadata_entry(stats, arrays, split, algorithm="reference", pad_seq_to_mult=1, num_truncated=0,
                                    num_dropped=0, converted_from=str(source), files=file_checksums(staged))
            entries.append(entry)
            written.append(PreparedSplit(split, size, final, entry))
            log(summary_line(entry))
        write_metadata(run.staged(metadata_path(out_dir, size)), entries)
        run.commit()
    return written


def _metadata_entry(stats: PackingStats, arrays: PackedArrays, split: str, **extra) -> dict:
    """One line of ``<size>_metadata.jsonl``."""
    entry = asdict(stats)
    entry.update(packing_factor=round(stats.packing_factor, 4), packing_efficiency=round(stats.packing_efficiency, 4),
                 split=split, num_tokens=int(len(arrays.tokens)), format=FORMAT, **extra)
    return entry


def _split_off(samples: TokenizedSplit, fraction: float, seed: int) -> tuple[TokenizedSplit, TokenizedSplit]:
    """Seeded random validation subset (at least one sample when there are two or more)."""
    n = len(samples.source_index)
    k = min(n - 1, max(1, round(fraction * n))) if n > 1 else 0
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng(seed).permutation(n)[:k]] = True
    train, val = samples.take(np.flatnonzero(~chosen)), samples.take(np.flatnonzero(chosen))
    train.num_truncated, train.num_dropped = samples.num_truncated, samples.num_dropped
    return train, val


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(value: Any, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _plain_name(tokenizer: Any) -> str:
    if isinstance(tokenizer, (str, Path)):
        return Path(tokenizer).resolve().name
    return Path(getattr(tokenizer, "name_or_path", "") or "tokenizer").name


def flat_list_column(dataset, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, per-row lengths) of a ``datasets`` list column, chunk by chunk (no 2**31 offset limit);
    used by :class:`.dataset.PackedDataset`."""
    import pyarrow.compute as pc

    values, lengths = [], []
    for chunk in dataset.data.column(name).chunks:
        values.append(np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=dtype))
        lengths.append(np.asarray(pc.list_value_length(chunk).to_numpy(zero_copy_only=False), dtype=np.int64))
    if not values:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    return np.concatenate(values), np.concatenate(lengths)
