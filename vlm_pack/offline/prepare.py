"""Offline packing, step 1: tokenise an SFT dataset once, bin-pack it, write packs + metadata to disk.

Input: a JSONL file (one object per line) or a local ``datasets`` directory (``save_to_disk``), with a prompt
and a response field (names configurable) or, for the ``chat`` template, a ``messages`` list
(``[{"role": ..., "content": ...}]``). Templates:

* ``alpaca``: ``<bos>`` + an instruction header around the prompt + response + ``<eos>``;
* ``chat``: the tokenizer's own chat template (``apply_chat_template``).

The loss covers response tokens only (every assistant turn and its end-of-turn token for ``chat``); the mask
is built from character spans and the fast tokenizer's offsets, so each sample's tokens are exactly the
tokenizer's output for the rendered text. Tokenisation runs through ``datasets.Dataset.map`` (batched,
``num_proc`` workers, cached next to the loaded data: re-running with the same input and settings is instant).

Lengths: with ``max_seq_length`` a longer sample keeps its first ``max_seq_length`` tokens (counted as
``num_truncated``); a sample whose whole response was cut off is dropped (``num_dropped``). Without it, a sample
longer than the pack size is an error naming the sample. ``pad_seq_to_mult`` packs on lengths rounded up to
that multiple, so the collate-time alignment padding always fits (tokens are stored unpadded).

Validation: ``validation_path`` (a second file) or ``validation_fraction`` of the training rows (a seeded random
subset, taken after tokenisation, so ``source_index`` always points at the input row); neither: training only.

Output per pack size ``S`` (see ``storage.py`` for the files): ``<root>/packed/<tokenizer_name>/training_S.npy``,
``validation_S.npy`` and ``S_metadata.jsonl`` (one line per split: ``max_samples_per_bin``,
``dataset_max_seqlen``, ``min_packed_seqlen``, ``packing_factor``, ``packing_efficiency``, ``pack_size``,
``num_packs``, ``num_samples``, ``num_tokens``, ``algorithm``, ``seed``, ``pad_seq_to_mult``, ...).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from .algorithms import ALGORITHMS, PackingStats, group_by_pack, pack_lengths, packing_stats
from .storage import (
    FORMAT,
    PackedArrays,
    build_index,
    gather_segments,
    metadata_path,
    open_packed,
    sibling_paths,
    split_path,
    write_metadata,
    write_packed,
)

TEMPLATES = ("alpaca", "chat")
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{prompt}\n\n### Response:\n"
)


@dataclass(frozen=True)
class SampleFormat:
    """How records are read and rendered."""

    template: str = "alpaca"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")

    def check(self, record: Any, where: str) -> None:
        """Raise a ValueError naming ``where`` (file and line/row) when a record cannot become a sample."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        messages = record.get(self.messages_field)
        if self.template == "chat" and messages is not None:
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise ValueError(f"{where}: field {self.messages_field!r} must be a list of {{role, content}} strings")
            answers = [m["content"] for m in messages if m["role"] == "assistant"]
            if not answers:
                raise ValueError(f"{where}: {self.messages_field!r} has no assistant message, so nothing to train on")
            if not all(a.strip() for a in answers):
                raise ValueError(f"{where}: empty response (an assistant message has no content); fill or drop it")
            return
        for name, flag in ((self.prompt_field, "--prompt-field"), (self.response_field, "--response-field")):
            if record.get(name) is None:
                present = ", ".join(sorted(k for k, v in record.items() if v is not None))
                chat = f" or a {self.messages_field!r} list with --template chat" if self.template == "alpaca" else ""
                raise ValueError(
                    f"{where}: missing field {name!r} (present: {present}); name the right field with {flag}{chat}"
                )
            if not isinstance(record[name], str):
                raise ValueError(f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}")
        if not record[self.response_field].strip():
            raise ValueError(f"{where}: empty response in field {self.response_field!r}; fill or drop the sample")


class SampleEncoder:
    """``datasets.map`` function (batched, with indices): records -> input_ids, loss_mask, truncated flag."""

    def __init__(self, tokenizer, fmt: SampleFormat, max_seq_length: int | None, source: str):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer (tokenizer.json) is needed: loss masks come from its offset mapping")
        if fmt.template == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use template 'alpaca' or a tokenizer with one")
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_seq_length = max_seq_length
        self.source = source

    def fingerprint(self, dataset) -> str:
        """Cache key of ``dataset.map(self)``: the input's fingerprint + everything that shapes the output.

        Computed here because letting ``datasets`` hash the function pickles the whole tokenizer (seconds).
        """
        tok = self.tokenizer
        h = hashlib.sha256()
        for part in (
            FORMAT, getattr(dataset, "_fingerprint", None) or repr(dataset.cache_files), repr(self.fmt),
            repr(self.max_seq_length), type(tok).__name__, tok.backend_tokenizer.to_str(),
            repr(getattr(tok, "chat_template", None)), repr((tok.bos_token, tok.eos_token)),
        ):
            h.update(part.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()[:32]

    def render(self, record: dict, where: str) -> tuple[str, list[tuple[int, int]]]:
        """Full text of one sample and the character spans that carry the loss."""
        self.fmt.check(record, where)
        fmt, tok = self.fmt, self.tokenizer
        eos = tok.eos_token or ""
        if fmt.template == "alpaca":
            head = (tok.bos_token or "") + ALPACA_PROMPT.format(prompt=record[fmt.prompt_field])
            text = head + record[fmt.response_field] + eos
            return text, [(len(head), len(text))]
        messages = record.get(fmt.messages_field)
        if messages is None:
            messages = [
                {"role": "user", "content": record[fmt.prompt_field]},
                {"role": "assistant", "content": record[fmt.response_field]},
            ]
        text = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False)
        spans, cursor = [], 0
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            content = message["content"].strip()
            start = text.find(content, cursor)
            if start < 0:
                raise ValueError(
                    f"{where}: assistant message {turn} does not appear verbatim in the chat template's output, so its "
                    "loss span is unknown; use template 'alpaca' or a chat template that keeps assistant text as is"
                )
            end = start + len(content)
            if eos and text.startswith(eos, end):
                end += len(eos)  # the model must learn to end its turn
            spans.append((start, end))
            cursor = end
        return text, spans

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        columns = list(batch)
        texts, spans = [], []
        for row, index in enumerate(indices):
            text, span = self.render({c: batch[c][row] for c in columns}, f"{self.source}, row {index}")
            texts.append(text)
            spans.append(span)
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "source_index": list(indices), "truncated": []}
        for ids, offsets, span, index in zip(encoded["input_ids"], encoded["offset_mapping"], spans, indices):
            starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            mask = np.zeros(len(ids), dtype=np.uint8)
            for lo, hi in span:
                mask |= (starts >= lo) & (starts < hi)
            if not mask.any():
                raise ValueError(
                    f"{self.source}, row {index}: the response has no token of its own after tokenisation "
                    "(it merged into the prompt); check the template and the response text"
                )
            cut = self.max_seq_length is not None and len(ids) > self.max_seq_length
            if cut:
                ids, mask = ids[: self.max_seq_length], mask[: self.max_seq_length]
            out["input_ids"].append(list(ids))
            out["loss_mask"].append(mask.tolist())
            out["truncated"].append(cut)
        return out


@dataclass
class TokenizedSplit:
    """Samples of one split as flat arrays: tokens/loss_mask with per-sample offsets."""

    tokens: np.ndarray  # int32 [num_tokens]
    loss_mask: np.ndarray  # uint8 [num_tokens]
    offsets: np.ndarray  # int64 [num_samples + 1]
    source_index: np.ndarray  # int64 [num_samples]
    num_truncated: int = 0
    num_dropped: int = 0

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, rows: np.ndarray) -> "TokenizedSplit":
        """The samples ``rows`` (in that order), with counters reset."""
        tokens, offsets = gather_segments(self.tokens, self.offsets, rows)
        mask, _ = gather_segments(self.loss_mask, self.offsets, rows)
        return TokenizedSplit(tokens, mask, offsets, self.source_index[rows])


@dataclass
class PreparedSplit:
    """One written split at one pack size."""

    split: str
    pack_size: int
    path: Path
    metadata: dict


def load_records(path: str | Path, fmt: SampleFormat, *, cache_dir: str | None = None, progress: bool = True):
    """Load a JSONL file (validated line by line first: errors name the line) or a ``save_to_disk`` directory.

    Returns ``(train, validation_or_None)`` as ``datasets.Dataset`` objects backed by cache files.
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input {path} not found")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            train_key = next((k for k in ("train", "training") if k in loaded), None)
            if train_key is None:
                raise ValueError(f"{path}: DatasetDict has splits {list(loaded)}; expected 'train' (and 'validation')")
            return loaded[train_key], loaded.get("validation")
        return loaded, None
    count = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(tqdm(f, desc=f"checking {path.name}", unit=" lines", disable=not progress), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: malformed JSON ({err.msg} at column {err.colno}); fix or remove the line"
                ) from None
            fmt.check(record, f"{path}, line {number}")
            count += 1
    if count == 0:
        raise ValueError(f"{path}: no records (the file is empty)")
    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir), None


def tokenize_records(dataset, encoder: SampleEncoder, *, num_proc: int = 1, desc: str = "tokenizing") -> TokenizedSplit:
    """Tokenise with ``Dataset.map`` (batched, parallel, cached) and flatten to arrays; drop loss-free samples."""
    from datasets import Features, List, Value

    features = Features({
        "input_ids": List(Value("int32")), "loss_mask": List(Value("uint8")),
        "source_index": Value("int64"), "truncated": Value("bool"),
    })
    mapped = dataset.map(
        encoder, batched=True, with_indices=True, remove_columns=dataset.column_names, features=features,
        num_proc=num_proc if num_proc > 1 else None, desc=desc, new_fingerprint=encoder.fingerprint(dataset),
    )
    tokens, lengths = flat_list_column(mapped, "input_ids", np.int32)
    mask, _ = flat_list_column(mapped, "loss_mask", np.uint8)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    source = np.asarray(mapped.data.column("source_index").to_numpy(), dtype=np.int64)
    truncated = np.asarray(mapped.data.column("truncated").to_numpy(zero_copy_only=False), dtype=bool)
    split = TokenizedSplit(tokens, mask, offsets, source)
    has_loss = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) > 0 if len(lengths) else np.zeros(0, bool)
    has_loss &= lengths > 0
    if not has_loss.all():
        split = split.take(np.flatnonzero(has_loss))
    split.num_truncated = int(truncated[has_loss].sum())
    split.num_dropped = int((~has_loss).sum())
    return split


def flat_list_column(dataset, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, per-row lengths) of a list column, chunk by chunk (no 2**31 offset limit)."""
    import pyarrow.compute as pc

    values, lengths = [], []
    for chunk in dataset.data.column(name).chunks:
        values.append(np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=dtype))
        lengths.append(np.asarray(pc.list_value_length(chunk).to_numpy(zero_copy_only=False), dtype=np.int64))
    if not values:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    return np.concatenate(values), np.concatenate(lengths)


def pack_split(samples: TokenizedSplit, pack_size: int, *, algorithm: str = "best_fit_decreasing", seed: int = 0,
               pad_seq_to_mult: int = 1, split: str = "training") -> tuple[PackedArrays, PackingStats]:
    """Bin-pack one tokenised split; returns the arrays to write (samples regrouped pack by pack) and stats."""
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
    bin_ids = pack_lengths(padded, pack_size, algorithm, seed)
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


def prepare_packed_sequence_data(
    train_path: str | Path,
    tokenizer: str | Path | Any,
    output_root: str | Path,
    pack_sizes: int | list[int],
    *,
    validation_path: str | Path | None = None,
    validation_fraction: float = 0.0,
    template: str = "alpaca",
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    max_seq_length: int | None = None,
    algorithm: str = "best_fit_decreasing",
    seed: int = 0,
    pad_seq_to_mult: int = 1,
    num_proc: int = 1,
    global_batch_size: int | None = None,
    tokenizer_name: str | None = None,
    overwrite: bool = False,
    cache_dir: str | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[PreparedSplit]:
    """Tokenise, pack and write a dataset for every pack size; returns what was written.

    ``tokenizer`` is a local path (loaded with ``AutoTokenizer``) or a tokenizer object; ``tokenizer_name``
    (default: the path's folder name) names the output folder ``<output_root>/packed/<tokenizer_name>``.
    Existing output is an error unless ``overwrite``. Prints, per pack size, the packing factor ``n``, the
    efficiency and, with ``global_batch_size``, how many packs per step keep the same samples per step.

    A ``.npy`` input is taken as already-packed data in the reference pickle format and converted as is
    (packs unchanged, one pack size); reading it needs ``allow_pickle=True`` (trusted files only).
    """
    sizes = sorted({int(s) for s in ([pack_sizes] if isinstance(pack_sizes, int) else pack_sizes)})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"pack sizes must be positive integers, got {pack_sizes}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if max_seq_length is not None and max_seq_length < 1:
        raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
    if pad_seq_to_mult < 1:
        raise ValueError(f"pad_seq_to_mult must be >= 1, got {pad_seq_to_mult}")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if validation_path is not None and validation_fraction:
        raise ValueError("give either validation_path or validation_fraction, not both")
    for source in (train_path, validation_path):
        if source is not None and not Path(source).exists():
            raise FileNotFoundError(f"input {source} not found")
    fmt = SampleFormat(template, prompt_field, response_field, messages_field)
    if isinstance(tokenizer, (str, Path)):
        tokenizer_name = tokenizer_name or Path(tokenizer).name
    else:
        tokenizer_name = tokenizer_name or Path(getattr(tokenizer, "name_or_path", "") or "tokenizer").name
    out_dir = Path(output_root) / "packed" / tokenizer_name
    if Path(train_path).suffix == ".npy":
        inputs = {"training": train_path, "validation": validation_path}
        return _convert_reference(inputs, out_dir, sizes, allow_pickle=allow_pickle, overwrite=overwrite, log=log)
    _claim_outputs(out_dir, sizes, overwrite)
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))

    train_raw, dir_validation = load_records(train_path, fmt, cache_dir=cache_dir, progress=progress)
    splits = {"training": tokenize_records(
        train_raw, SampleEncoder(tokenizer, fmt, max_seq_length, str(train_path)), num_proc=num_proc,
        desc="tokenizing training")}
    if validation_path is not None:
        val_raw, _ = load_records(validation_path, fmt, cache_dir=cache_dir, progress=progress)
    else:
        val_raw = dir_validation
    if val_raw is not None:
        splits["validation"] = tokenize_records(
            val_raw, SampleEncoder(tokenizer, fmt, max_seq_length, str(validation_path or train_path)),
            num_proc=num_proc, desc="tokenizing validation")
    elif validation_fraction:
        splits["training"], splits["validation"] = _split_off(splits["training"], validation_fraction, seed)

    written = []
    for size in tqdm(sizes, desc="packing", disable=not progress or len(sizes) == 1):
        entries = []
        for split, samples in splits.items():
            if len(samples.source_index) == 0:
                raise ValueError(f"the {split} split has no sample left to pack (all were dropped)")
            arrays, stats = pack_split(samples, size, algorithm=algorithm, seed=seed,
                                       pad_seq_to_mult=pad_seq_to_mult, split=split)
            path = write_packed(split_path(out_dir, split, size), arrays)
            entry = _metadata_entry(
                stats, arrays, split, algorithm=algorithm, seed=seed, pad_seq_to_mult=pad_seq_to_mult,
                max_seq_length=max_seq_length, template=template, tokenizer=tokenizer_name,
                num_truncated=samples.num_truncated, num_dropped=samples.num_dropped,
            )
            entries.append(entry)
            written.append(PreparedSplit(split, size, path, entry))
            log(summary_line(entry, global_batch_size))
        write_metadata(metadata_path(out_dir, size), entries)
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
    _claim_outputs(out_dir, sizes, overwrite)
    written, entries = [], []
    for split, source in inputs.items():
        if source is None:
            continue
        arrays = open_packed(source, allow_pickle=True)
        lengths = arrays.sample_lengths()
        loads = arrays.pack_loads()
        if len(loads) and loads.max() > size:
            i = int(np.argmax(loads))
            raise ValueError(
                f"{source}: pack {i} holds {loads[i]} tokens, more than the pack size {size}; pass the size it was "
                "packed to"
            )
        stats = packing_stats(lengths, np.repeat(np.arange(arrays.num_packs), arrays.samples_per_pack()), size)
        path = write_packed(split_path(out_dir, split, size), arrays)
        entry = _metadata_entry(stats, arrays, split, algorithm="reference", pad_seq_to_mult=1, num_truncated=0,
                                num_dropped=0, converted_from=str(source))
        entries.append(entry)
        written.append(PreparedSplit(split, size, path, entry))
        log(summary_line(entry))
    write_metadata(metadata_path(out_dir, size), entries)
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


def _claim_outputs(out_dir: Path, sizes: list[int], overwrite: bool) -> None:
    """Refuse to clobber earlier output unless ``overwrite``; with it, remove every file we would write."""
    existing = []
    for size in sizes:
        for split in ("training", "validation"):
            index = split_path(out_dir, split, size)
            existing += [index, *sibling_paths(index).values()]
        existing.append(metadata_path(out_dir, size))
    existing = [p for p in existing if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{existing[0]} already exists ({len(existing)} output file(s) in {out_dir}); pass --overwrite "
            "(overwrite=True) to replace them, or choose another output directory"
        )
    for p in existing:
        p.unlink()
