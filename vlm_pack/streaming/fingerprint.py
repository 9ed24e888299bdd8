"""What a saved stream state is checked against on resume: the source's shards and the collator's settings, each
identified by what changes the packs, never by where it was loaded from.

* Source (:func:`source_fingerprint`): the ``datasets.IterableDataset``'s pipeline, root first. Files
  (``load_dataset(..., streaming=True)``): each shard's file name and size (not its folder: a copy on another node
  resumes). In-memory shards (``Dataset.to_iterable_dataset``): each shard's row count and ``datasets`` fingerprint.
  A generator (``IterableDataset.from_generator``): its qualified name and a digest of its keyword arguments (the
  list-typed ones are what ``datasets`` splits into shards; a user's own argument named ``shards`` is one of them,
  never taken for in-memory shards). ``map`` / ``filter`` / ``interleave_datasets`` / ``shuffle`` steps: their
  kind and function name, the interleaved sources each described the same way.
* Processor (:func:`processor_fingerprint`): its class, a digest of the tokenizer's serialized model (vocabulary,
  merges, normalizer, added tokens; not its runtime truncation / padding switches), its special tokens, its chat
  template and its image / video / audio settings (``ProcessorMixin.to_dict``).

Values are JSON: ranks and processes compute the same fingerprint for the same input.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = ["collator_fingerprint", "processor_fingerprint", "source_files", "source_fingerprint"]

_FILE_KEYS = ("original_files", "base_files")


def _digest(value: Any) -> str:
    """A short stable digest of a JSON-able value (anything else counts by its type name)."""
    text = json.dumps(value, sort_keys=True, default=lambda o: type(o).__qualname__)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _root(iterable: Any) -> Any:
    """The innermost examples iterable of a single-source pipeline (None when it branches)."""
    while getattr(iterable, "ex_iterable", None) is not None:
        iterable = iterable.ex_iterable
    return None if getattr(iterable, "ex_iterables", None) is not None else iterable


def source_files(source: Any) -> list[str] | None:
    """The file behind each shard of a ``load_dataset(..., streaming=True)`` source (None when not files)."""
    root = _root(getattr(source, "_ex_iterable", None))
    kwargs = getattr(root, "kwargs", None) or {}
    for key in _FILE_KEYS:
        files = kwargs.get(key)
        if isinstance(files, list) and len(files) == source.n_shards and all(isinstance(f, str) for f in files):
            return files
    return None


def _function_name(function: Any) -> str | None:
    """``module.qualname`` of a function or bound method (None for None)."""
    function = getattr(function, "__func__", function)
    if function is None:
        return None
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', type(function).__name__)}"


def _leaf(iterable: Any) -> dict:
    """One data source of the pipeline: files, in-memory shards or a generator with its keyword arguments."""
    kwargs = dict(getattr(iterable, "kwargs", None) or {})
    for key in _FILE_KEYS:
        files = kwargs.get(key)
        if isinstance(files, list) and all(isinstance(f, str) for f in files):
            return {"files": [[os.path.basename(f), os.path.getsize(f) if os.path.isfile(f) else None] for f in files]}
    generate = getattr(iterable, "generate_examples_fn", None) or getattr(iterable, "generate_tables_fn", None)
    shards = kwargs.get("shards")
    if isinstance(shards, list) and shards and all(hasattr(s, "_fingerprint") and hasattr(s, "num_rows")
                                                   for s in shards):
        return {"dataset_shards": [[s.num_rows, s._fingerprint] for s in shards]}
    builder = getattr(generate, "__self__", None)
    generator = getattr(getattr(builder, "config", None), "generator", None)
    return {"generator": _function_name(generator or generate), "kwargs": _digest(kwargs)}


def _describe(iterable: Any) -> list:
    """The pipeline from its source(s) to the stream, one entry per step."""
    steps = []
    while iterable is not None:
        inner = getattr(iterable, "ex_iterables", None)
        if inner is not None:
            steps.append({"interleave": type(iterable).__name__, "sources": [_describe(x) for x in inner],
                          "probabilities": [float(p) for p in (getattr(iterable, "probabilities", None) or [])],
                          "stopping_strategy": getattr(iterable, "stopping_strategy", None)})
            break
        nested = getattr(iterable, "ex_iterable", None)
        if nested is None:
            steps.append(_leaf(iterable))
            break
        step = {"step": type(iterable).__name__}
        function = getattr(iterable, "function", None)
        if function is not None:
            step["function"] = _function_name(function)
        steps.append(step)
        iterable = nested
    return steps[::-1]


def source_fingerprint(source: Any) -> list:
    """The source pipeline, root first (see the module doc): equal for the same data read from another folder."""
    iterable = getattr(source, "_ex_iterable", None)
    if iterable is None:
        return [{"stream": type(source).__name__, "n_shards": source.n_shards}]
    return _describe(iterable)


def processor_fingerprint(processor: Any) -> dict:
    """What of a processor / tokenizer changes the packs (see the module doc), each as a short digest."""
    tokenizer = getattr(processor, "tokenizer", None) or processor
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str())
        for switch in ("truncation", "padding"):  # set per call by the tokenizer, not part of what it encodes
            model.pop(switch, None)
    else:
        model = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else None
    special = {"map": getattr(tokenizer, "special_tokens_map", None),
               "ids": sorted(getattr(tokenizer, "all_special_ids", None) or []),
               **{k: getattr(tokenizer, k, None) for k in ("add_bos_token", "add_eos_token", "padding_side")}}
    templates = [getattr(processor, "chat_template", None), getattr(tokenizer, "chat_template", None)]
    settings = processor.to_dict() if processor is not tokenizer and hasattr(processor, "to_dict") else None
    return {"processor_class": type(processor).__name__, "vocabulary": _digest(model),
            "special_tokens": _digest(special), "processor_chat_template": _digest(templates),
            "processor_settings": _digest(settings)}


def collator_fingerprint(collator: Any) -> dict:
    """The collator settings that change a sample's length or a pack's layout."""
    template = getattr(collator, "chat_template", None) or ""
    chat = getattr(collator, "chat", None)
    return {
        "class": type(collator).__name__,
        **processor_fingerprint(getattr(collator, "processor", None)),
        "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16],
        "template_kwargs": {k: repr(v) for k, v in sorted(dict(getattr(chat, "kwargs", {}) or {}).items())},
        "family": getattr(getattr(collator, "family", None), "name", None),
        "max_length": collator.max_length,
        "pad_to_multiple_of": collator.pad_to_multiple_of,
        "pad_to_length": getattr(collator, "pad_to_length", None),
    }
