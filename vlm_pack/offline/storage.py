"""On-disk format of offline packed data: flat, memory-mappable ``.npy`` arrays, never pickle.

For one split (``training`` / ``validation``) and pack size ``S``, in ``<root>/packed/<tokenizer_name>/``::

    training_S.npy               pack index, one record per pack (structured dtype ``PACK_INDEX_DTYPE``):
                                 sample_start, sample_end -> rows of the per-sample arrays below
                                 token_start, token_end   -> slots of tokens / loss_mask
    training_S.tokens.npy        int32 [num_tokens]       token ids, pack after pack, sample after sample
    training_S.loss_mask.npy     uint8 [num_tokens]       1 where the token is a target (response) token,
                                                          ALIGNED with tokens (label of slot t is token t)
    training_S.seq_offsets.npy   int64 [num_samples + 1]  token offset of every sample (in pack order)
    training_S.source_index.npy  int64 [num_samples]      row of every sample in its split's input
    S_metadata.jsonl             one JSON object per line, one line per split (see ``prepare.py``)

Every file loads with ``np.load(path, mmap_mode="r", allow_pickle=False)``: opening a dataset of any size
costs no memory, and an untrusted file cannot execute code. Tokens are stored unpadded; alignment padding
(``pad_seq_to_mult``) and fill up to the pack size are added at collate time.

The reference systems' format (one ``.npy`` object array of dicts with ``input_ids``, ``loss_mask``,
``seq_start_id``) needs pickle to load; :func:`open_packed` reads it only with ``allow_pickle=True``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "vlm_pack.offline.v1"
SPLITS = ("training", "validation")
PACK_INDEX_DTYPE = np.dtype(
    [("sample_start", "<i8"), ("sample_end", "<i8"), ("token_start", "<i8"), ("token_end", "<i8")]
)
_SIBLINGS = ("tokens", "loss_mask", "seq_offsets", "source_index")


def split_path(directory: str | Path, split: str, pack_size: int) -> Path:
    """``<directory>/<split>_<pack_size>.npy``: the pack index, the path users pass around."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(directory) / f"{split}_{int(pack_size)}.npy"


def metadata_path(directory: str | Path, pack_size: int) -> Path:
    """``<directory>/<pack_size>_metadata.jsonl``."""
    return Path(directory) / f"{int(pack_size)}_metadata.jsonl"


def sibling_paths(index_path: str | Path) -> dict[str, Path]:
    """The files that belong to a pack index: ``training_S.tokens.npy`` and so on."""
    index_path = Path(index_path)
    stem = index_path.name[: -len(".npy")] if index_path.name.endswith(".npy") else index_path.name
    return {name: index_path.with_name(f"{stem}.{name}.npy") for name in _SIBLINGS}


@dataclass
class PackedArrays:
    """The arrays of one packed split (memory-mapped when read from our format)."""

    index: np.ndarray  # PACK_INDEX_DTYPE [num_packs]
    tokens: np.ndarray  # int [num_tokens]
    loss_mask: np.ndarray  # uint8/bool [num_tokens]
    seq_offsets: np.ndarray  # int64 [num_samples + 1]
    source_index: np.ndarray  # int64 [num_samples]

    @property
    def num_packs(self) -> int:
        return len(self.index)

    @property
    def num_samples(self) -> int:
        return len(self.seq_offsets) - 1

    def pack(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, loss_mask, sample lengths)`` of pack ``i``."""
        s0, s1, t0, t1 = (int(v) for v in self.index[i].tolist())
        return (
            np.asarray(self.tokens[t0:t1]),
            np.asarray(self.loss_mask[t0:t1]),
            np.diff(np.asarray(self.seq_offsets[s0 : s1 + 1])),
        )

    def sample_lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.seq_offsets))

    def samples_per_pack(self) -> np.ndarray:
        return np.asarray(self.index["sample_end"] - self.index["sample_start"])

    def pack_loads(self, pad_seq_to_mult: int = 1) -> np.ndarray:
        """Slots each pack fills once every sample is aligned to a multiple of ``pad_seq_to_mult`` (int64)."""
        lengths = self.sample_lengths()
        if not len(lengths):
            return np.zeros(self.num_packs, dtype=np.int64)
        aligned = -(-lengths // pad_seq_to_mult) * pad_seq_to_mult
        return np.add.reduceat(aligned, np.asarray(self.index["sample_start"]))

    def validate(self, source: str) -> "PackedArrays":
        """Check that the arrays describe each other consistently (a truncated or mixed-up file fails here)."""
        n_tok, n_samp = len(self.tokens), self.num_samples
        problems = []
        if len(self.loss_mask) != n_tok:
            problems.append(f"loss_mask has {len(self.loss_mask)} entries but tokens {n_tok}")
        if len(self.source_index) != n_samp:
            problems.append(f"source_index has {len(self.source_index)} entries but there are {n_samp} samples")
        if n_samp >= 0 and (self.seq_offsets[0] != 0 or self.seq_offsets[-1] != n_tok):
            problems.append(f"seq_offsets must run from 0 to the token count {n_tok}")
        if self.num_packs:
            idx = self.index
            offsets = np.asarray(self.seq_offsets)
            if (idx["sample_start"][0] != 0 or idx["sample_end"][-1] != n_samp
                    or np.any(idx["sample_start"][1:] != idx["sample_end"][:-1])
                    or np.any(idx["sample_end"] <= idx["sample_start"])):
                problems.append("pack index sample ranges must tile the samples, each pack non-empty")
            elif np.any(offsets[idx["sample_start"]] != idx["token_start"]) or np.any(
                offsets[idx["sample_end"]] != idx["token_end"]
            ):
                problems.append("pack index token ranges disagree with seq_offsets")
        if problems:
            raise ValueError(f"{source}: inconsistent packed data ({'; '.join(problems)}); re-run `vlm-pack prepare`")
        return self


def write_packed(index_path: str | Path, arrays: PackedArrays) -> Path:
    """Write ``arrays`` as ``index_path`` plus its siblings (no pickle); returns ``index_path``."""
    index_path = Path(index_path)
    index_path.parent.mkdir(parents=True, exist_ok=True)
    arrays.validate(str(index_path))
    files = sibling_paths(index_path)
    np.save(files["tokens"], np.asarray(arrays.tokens, dtype=np.int32), allow_pickle=False)
    np.save(files["loss_mask"], np.asarray(arrays.loss_mask, dtype=np.uint8), allow_pickle=False)
    np.save(files["seq_offsets"], np.asarray(arrays.seq_offsets, dtype=np.int64), allow_pickle=False)
    np.save(files["source_index"], np.asarray(arrays.source_index, dtype=np.int64), allow_pickle=False)
    np.save(index_path, np.asarray(arrays.index, dtype=PACK_INDEX_DTYPE), allow_pickle=False)  # last: marks done
    return index_path


def _header_dtype(path: Path) -> np.dtype:
    """dtype of a ``.npy`` file, read from its header without loading (or unpickling) anything."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as err:
            raise ValueError(f"{path} is not a .npy file ({err})") from None
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return reader(f)[2]


def open_packed(
    path: str | Path, *, allow_pickle: bool = False, reference_loss_mask_shifted: bool = True
) -> PackedArrays:
    """Open a packed split: our format memory-mapped, or (opt-in) the reference pickle format in memory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"packed data {path} not found; create it with `vlm-pack prepare`")
    dtype = _header_dtype(path)
    if dtype == PACK_INDEX_DTYPE:
        files = sibling_paths(path)
        missing = [str(p) for p in files.values() if not p.exists()]
        if missing:
            raise FileNotFoundError(
                f"{path}: companion file(s) missing: {', '.join(missing)}; re-run `vlm-pack prepare`"
            )
        load = lambda p: np.load(p, mmap_mode="r", allow_pickle=False)  # noqa: E731
        return PackedArrays(
            index=load(path), tokens=load(files["tokens"]), loss_mask=load(files["loss_mask"]),
            seq_offsets=load(files["seq_offsets"]), source_index=load(files["source_index"]),
        ).validate(str(path))
    if dtype.hasobject:
        if not allow_pickle:
            raise ValueError(
                f"{path} holds Python objects (the reference .npy-of-dicts format): loading it runs pickle, which can "
                "execute code from the file. Convert it with `vlm-pack prepare`, or pass allow_pickle=True "
                "(--allow-pickle) if you trust the file"
            )
        return read_reference(path, loss_mask_shifted=reference_loss_mask_shifted)
    raise ValueError(
        f"{path}: unrecognised packed data (dtype {dtype}); expected a pack index written by `vlm-pack prepare`"
    )


def read_reference(path: str | Path, *, loss_mask_shifted: bool = True) -> PackedArrays:
    """Read the reference ``.npy``-of-dicts packs (USES PICKLE: trusted files only) into our arrays.

    Each pack dict has ``input_ids``, ``loss_mask`` and ``seq_start_id`` (start of every sample). The reference
    writer stores the loss mask shifted left by one (``loss_mask[t]`` marks that token ``t + 1`` is a target);
    with ``loss_mask_shifted=True`` it is moved back to our aligned convention inside each sample.
    """
    packs = np.load(path, allow_pickle=True)
    tokens, masks, lengths, per_pack = [], [], [], []
    for i, pack in enumerate(packs):
        try:
            ids = np.asarray(pack["input_ids"], dtype=np.int64)
            mask = np.asarray(pack["loss_mask"]).astype(np.uint8)
            starts = np.asarray(list(pack["seq_start_id"]) + [len(ids)], dtype=np.int64)
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(
                f"{path}: pack {i} is not a dict with input_ids, loss_mask and seq_start_id ({err!r})"
            ) from None
        if len(mask) != len(ids) or starts[0] != 0 or np.any(np.diff(starts) <= 0):
            raise ValueError(f"{path}: pack {i} has inconsistent input_ids / loss_mask / seq_start_id")
        if loss_mask_shifted:
            aligned = np.zeros_like(mask)
            aligned[1:] = mask[:-1]
            aligned[starts[:-1]] = 0  # a sample's first token has no prediction inside the sample
            mask = aligned
        tokens.append(ids)
        masks.append(mask)
        lengths.append(np.diff(starts))
        per_pack.append(len(starts) - 1)
    seq_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    seq_offsets = np.concatenate(([0], np.cumsum(seq_lengths))).astype(np.int64)
    return PackedArrays(
        index=build_index(np.asarray(per_pack, dtype=np.int64), seq_offsets),
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64),
        loss_mask=np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8),
        seq_offsets=seq_offsets,
        source_index=np.full(len(seq_lengths), -1, dtype=np.int64),  # unknown in the reference format
    ).validate(str(path))


def gather_segments(flat: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate segments ``rows`` of a flat array (segment i = ``flat[offsets[i]:offsets[i+1]]``), vectorised.

    Returns the new flat array and its offsets.
    """
    rows = np.asarray(rows, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = offsets[rows + 1] - offsets[rows]
    new_offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    index = np.repeat(offsets[rows] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return np.asarray(flat)[index], new_offsets


def build_index(samples_per_pack: np.ndarray, seq_offsets: np.ndarray) -> np.ndarray:
    """Pack index records from the number of samples in each pack and the per-sample token offsets."""
    ends = np.cumsum(samples_per_pack)
    index = np.empty(len(samples_per_pack), dtype=PACK_INDEX_DTYPE)
    index["sample_start"] = ends - samples_per_pack
    index["sample_end"] = ends
    index["token_start"] = seq_offsets[index["sample_start"]]
    index["token_end"] = seq_offsets[index["sample_end"]]
    return index


def write_metadata(path: str | Path, entries: list[dict]) -> None:
    """Write metadata as JSON Lines (one object per split)."""
    with open(path, "w", encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps(entry, sort_keys=True) + "\n")


def read_metadata(path: str | Path) -> list[dict]:
    """Read ``<size>_metadata.jsonl``: JSON Lines, or the reference writers' single JSON list."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if not text:
        raise ValueError(f"{path}: metadata file is empty; re-run `vlm-pack prepare`")
    if text.startswith("["):
        entries = json.loads(text)
    else:
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
    if not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: every metadata entry must be a JSON object")
    return entries
