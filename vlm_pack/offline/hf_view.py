"""``to_hf_dataset``: one call from vlm_pack data to a ``datasets`` object that TRL's ``SFTTrainer`` accepts.

TRL 1.16 takes only ``datasets.Dataset`` / ``IterableDataset`` and keeps, by default, only the columns it knows:
``input_ids``, ``labels``, ``seq_lengths`` for text, ``messages``, ``images`` (and ``prompt``/``completion``/
``image``) for vision data. The views below use exactly those columns:

* packs (:class:`PackedSFTDataset`, :class:`PackedDataset`): one row per pack, ``input_ids``, ``labels``
  (-100 off-target), ``position_ids`` and ``seq_lengths``; collate with the dataset's own ``collate_fn`` /
  ``collate``, which reads the boundaries from ``seq_lengths`` (TRL) or ``position_ids`` (Trainer). Pass
  ``SFTConfig(dataset_kwargs={"skip_prepare_dataset": True})`` so TRL does not truncate the packs again (the
  collate refuses a cut pack);
* chat examples (what ``VLMPackingCollator`` takes): every ``content`` becomes a list of ``{"type", "text"}``
  parts and images move, in order, to an ``images`` column of ``datasets.Image`` (Arrow cannot hold the mixed
  string / list ``content`` the collator also accepts). The collator reads these rows back unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..data.chat import normalize_example
from .dataset import PackedDataset, PackedSFTDataset

__all__ = ["to_hf_dataset"]


def _pack_rows(packs: PackedSFTDataset | PackedDataset) -> Iterator[dict[str, list[int]]]:
    for i in range(len(packs)):
        item = packs[i]
        positions = np.asarray(item["position_ids"])
        starts = np.flatnonzero(positions == 0)
        yield {
            "input_ids": np.asarray(item["input_ids"]).tolist(),
            "labels": np.asarray(item["labels"]).tolist(),
            "position_ids": positions.tolist(),
            "seq_lengths": np.diff(np.append(starts, positions.size)).tolist(),
        }


_UNCARRIED = (
    "to_hf_dataset: {where} carries {fields}, which the template renders but the messages column (role and text / "
    "image parts) cannot hold, so training on this view would drop them; give transformers.Trainer the examples "
    "themselves (train_dataset=examples, data_collator=VLMPackingCollator(...)) instead"
)


def _chat_rows(examples: Sequence[Any], with_images: bool) -> Iterator[dict[str, Any]]:
    for index, example in enumerate(examples):
        if isinstance(example, Mapping) and example.get("tools") is not None:
            raise ValueError(_UNCARRIED.format(where=f"example {index}", fields="['tools']"))
        images, messages = [], []
        for number, turn in enumerate(normalize_example(example, index, allow_images=with_images)):
            extra = sorted(k for k, v in turn.items() if k not in ("role", "content") and v is not None)
            if extra:
                raise ValueError(_UNCARRIED.format(where=f"example {index}, turn {number}", fields=extra))
            parts = []
            for part in turn["content"]:
                if part["type"] == "image":
                    images.append(part["image"])
                    parts.append({"type": "image", "text": None})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            messages.append({"role": turn["role"], "content": parts})
        yield {"messages": messages, "images": images} if with_images else {"messages": messages}


def _has_image(example: Any) -> bool:
    """Whether an example (in any form the collator accepts) carries an image, without decoding anything."""
    if isinstance(example, Mapping):
        if example.get("images"):
            return True
        example = example.get("messages", example.get("conversations")) or []
    return any(
        isinstance(part, Mapping) and part.get("type") == "image"
        for turn in example if isinstance(turn, Mapping) and not isinstance(turn.get("content"), str)
        for part in turn.get("content") or []
    )


def to_hf_dataset(source: PackedSFTDataset | PackedDataset | Sequence[Any], *, streaming: bool = False):
    """A ``datasets.Dataset`` (or, with ``streaming=True``, a lazy ``IterableDataset``) view of ``source``.

    ``source``: offline packs or a sequence of chat examples. Chat examples with at least one image get an
    ``images`` column (TRL then treats the data as vision data and skips its own preprocessing); text-only ones
    get ``messages`` only. Invalid examples raise here, naming the sample.
    """
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    if isinstance(source, (PackedSFTDataset, PackedDataset)):
        features = datasets.Features({"input_ids": ints, "labels": ints, "position_ids": ints, "seq_lengths": ints})
        rows, kwargs = _pack_rows, {"packs": source}
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        with_images = any(_has_image(example) for example in source)
        part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
        turn = {"role": datasets.Value("string"), "content": datasets.List(part)}
        columns = {"messages": datasets.List(turn)}
        if with_images:
            columns["images"] = datasets.List(datasets.Image())
        features = datasets.Features(columns)
        rows, kwargs = _chat_rows, {"examples": source, "with_images": with_images}
    else:
        raise ValueError(
            f"to_hf_dataset takes a PackedSFTDataset, a PackedDataset or a list of chat examples; got "
            f"{type(source).__name__}"
        )
    if streaming:
        return datasets.IterableDataset.from_generator(rows, features=features, gen_kwargs=kwargs)
    table = list(rows(**kwargs))
    return datasets.Dataset.from_list(table, features=features)
