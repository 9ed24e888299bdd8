"""Offline packing, tokenisation: records -> token ids + loss mask, with the label spans taken from the rendering.

Templates:

* ``alpaca``: ``<bos>`` + an instruction header around the prompt + response + ``<eos>``. The text is built
  piece by piece, so the response's character span is known by construction; the fast tokenizer's offsets
  map it onto tokens.
* ``chat``: the tokenizer's own chat template (or ``chat_template``), tokens exactly as ``apply_chat_template``
  gives them (every message field, the row's ``tools``); assistant spans from its ``{% generation %}`` blocks,
  TRL's training variant of it, the rendered text's markup, per-message sentinels or prefix renderings
  (``vlm_pack.data.chat_template``), mapped onto tokens by the fast tokenizer's offsets. Labels never come from
  searching the reply's text, so a reply that also occurs in the prompt, in a system prompt or in an earlier turn
  is labelled where the assistant said it.
* ``auto`` (default): ``chat`` when the first record has the messages field and no prompt field, else ``alpaca``.

Each sample's tokens are exactly the tokenizer's output for the rendered text. With ``max_seq_length`` a longer
sample keeps its first ``max_seq_length`` tokens (counted); one left with no target token is dropped (counted).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .records import Records
from .storage import gather_segments

TEMPLATES = ("auto", "alpaca", "chat")
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{prompt}\n\n### Response:\n"
)
# Message fields that make an assistant turn something to train on besides its content.
_ANSWER_FIELDS = ("tool_calls", "reasoning_content", "thinking", "reasoning")
BATCH_ROWS = 1000  # rows per tokenizer call: the fast tokenizer encodes a batch on all cores
MIN_ROWS_PER_PROCESS = 5000  # below this a worker process costs more to start than it saves


@dataclass(frozen=True)
class SampleFormat:
    """How records are read and rendered."""

    template: str = "auto"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")

    def resolved(self, first: Any) -> "SampleFormat":
        """``auto`` -> ``chat`` if the first record has the messages field and no prompt field, else ``alpaca``."""
        if self.template != "auto":
            return self
        chat = isinstance(first, dict) and first.get(self.messages_field) is not None and (
            first.get(self.prompt_field) is None)
        return replace(self, template="chat" if chat else "alpaca")

    def check(self, record: Any, where: str) -> None:
        """Raise a ValueError naming ``where`` (file and line/row) when a record cannot become a sample."""
        if self.template == "auto":
            raise ValueError("resolve the 'auto' template with SampleFormat.resolved(first_record) first")
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        messages = record.get(self.messages_field)
        if self.template == "chat" and messages is not None:
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and (
                    isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
                for m in messages
            ):
                raise ValueError(f"{where}: field {self.messages_field!r} must be a list of {{role, content}} strings "
                                 "(content may be absent only beside tool_calls)")
            from ..data.chat_template import check_role

            for turn, message in enumerate(messages):
                check_role(message["role"], f"{where}, turn {turn}")
            answers = [m for m in messages if m["role"] == "assistant"]
            if not answers:
                raise ValueError(f"{where}: {self.messages_field!r} has no assistant message, so nothing to train on")
            if not any((m.get("content") or "").strip() or any(m.get(k) for k in _ANSWER_FIELDS) for m in answers):
                raise ValueError(f"{where}: empty response (no assistant message has content); fill or drop it")
            tools = record.get("tools")
            if tools is not None and not isinstance(tools, (list, str)):
                raise ValueError(f"{where}: field 'tools' must be a list of function schemas")
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
    """Rows -> ``(ids, loss mask)`` per row, for one resolved :class:`SampleFormat`."""

    def __init__(self, tokenizer, fmt: SampleFormat, max_seq_length: int | None, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        if fmt.template == "auto":
            raise ValueError("resolve the 'auto' template with SampleFormat.resolved(first_record) first")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer (tokenizer.json) is needed: loss masks come from its offset mapping")
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_seq_length = max_seq_length
        self.chat_template = None
        if fmt.template == "chat":
            from ..data.chat_template import resolve_chat_template

            self.chat_template = resolve_chat_template(tokenizer, chat_template, template_kwargs)

    def encode(self, rows: list[dict], wheres: list[str]) -> tuple[list[list[int]], list[np.ndarray]]:
        """Token ids and aligned loss masks (uint8) of ``rows`` (already checked); errors name ``wheres``."""
        if self.fmt.template == "alpaca":
            ids, masks = self._alpaca(rows)
        else:
            ids, masks = self._chat(rows, wheres)
        for mask, where in zip(masks, wheres):
            if not mask.any():
                raise ValueError(
                    f"{where}: the response has no token of its own after tokenisation (it merged into the prompt); "
                    "check the template and the response text"
                )
        return ids, masks

    def _alpaca(self, rows: list[dict]) -> tuple[list[list[int]], list[np.ndarray]]:
        tok, fmt = self.tokenizer, self.fmt
        heads = [(tok.bos_token or "") + ALPACA_PROMPT.format(prompt=r[fmt.prompt_field]) for r in rows]
        texts = [h + r[fmt.response_field] + (tok.eos_token or "") for h, r in zip(heads, rows)]
        encoded = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        masks = []
        for offsets, head in zip(encoded["offset_mapping"], heads):
            starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            masks.append((starts >= len(head)).astype(np.uint8))  # the response runs to the end of the text
        return encoded["input_ids"], masks

    def _conversation(self, row: dict) -> list[dict]:
        fmt = self.fmt
        messages = row.get(fmt.messages_field)
        if messages is None:
            messages = [{"role": "user", "content": row[fmt.prompt_field]},
                        {"role": "assistant", "content": row[fmt.response_field]}]
        return messages  # every field the template reads (reasoning, tool calls, names, ...), as given

    def _chat(self, rows: list[dict], wheres: list[str]) -> tuple[list[list[int]], list[np.ndarray]]:
        from ..data.chat_template import example_tools

        conversations = [self._conversation(r) for r in rows]
        tools = [example_tools(row, i) for i, row in enumerate(rows)]
        try:
            out = self._render(conversations, tools)
        except Exception:
            for conversation, chat_tools, where in zip(conversations, tools, wheres):  # name the first that fails
                try:
                    self._render([conversation], [chat_tools])
                except Exception as err:
                    raise ValueError(f"{where}: {str(err).removeprefix('sample 0: ')}") from None
            raise
        masks = [np.asarray(m, dtype=np.uint8) for m in out["assistant_masks"]]
        for conversation, mask, where in zip(conversations, masks, wheres):
            turns = sum(m["role"] == "assistant" and bool((m.get("content") or "").strip() or m.get("tool_calls"))
                        for m in conversation)
            runs = int(np.count_nonzero(np.diff(np.concatenate(([0], mask))) == 1))
            if runs < turns:  # HF stops marking at a block it cannot map (e.g. a reply glued to the prompt)
                raise ValueError(
                    f"{where}: {turns} assistant turns but only {runs} labelled spans after tokenisation; a reply's "
                    "first token merged with the text before it. Check the chat template (--chat-template)"
                )
        return out["input_ids"], masks

    def _render(self, conversations: list[list[dict]], tools: list):
        from ..data.chat_template import render_with_assistant_masks

        return render_with_assistant_masks(  # the tokenizer's own template's tokens (vlm_pack.data.chat_template)
            self.tokenizer, conversations, self.chat_template, tools,
            tokenizer_kwargs={"verbose": False},  # no "longer than the model's maximum" warning: we truncate
        )


@dataclass
class TokenizedSplit:
    """Samples of one split as flat arrays: tokens/loss_mask with per-sample offsets."""

    tokens: np.ndarray  # int32 [num_tokens]
    loss_mask: np.ndarray  # uint8 [num_tokens]
    offsets: np.ndarray  # int64 [num_samples + 1]
    source_index: np.ndarray  # int64 [num_samples]: row of the sample in its split's input
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


def check_records(records: Records, fmt: SampleFormat) -> SampleFormat:
    """Resolve ``auto`` from the first record and check every record; returns the resolved format."""
    fmt = fmt.resolved(records.rows[0] if records.rows else None)
    for i, row in enumerate(records.rows):
        fmt.check(row, records.where(i))
    return fmt


def tokenize_records(records: Records, encoder: SampleEncoder, *, num_proc: int = 1,
                     log: Callable[[str], None] = print, progress: bool = False) -> TokenizedSplit:
    """Tokenise checked records in batches (optionally in ``num_proc`` forked workers); drop loss-free samples."""
    from tqdm.auto import tqdm

    starts = range(0, len(records), BATCH_ROWS)
    jobs = [(records.rows[s:s + BATCH_ROWS], [records.where(i) for i in range(s, min(s + BATCH_ROWS, len(records)))])
            for s in starts]
    workers = _worker_count(num_proc, len(records), log)
    bar = tqdm(total=len(records), desc=f"tokenizing {records.source}", unit=" rows", disable=not progress)
    if workers > 1:
        import multiprocessing

        global _WORKER_ENCODER
        _WORKER_ENCODER = encoder  # inherited by the forked workers
        with multiprocessing.get_context("fork").Pool(workers, initializer=_quiet_tokenizer) as pool:
            results = []
            for result in pool.imap(_encode_job, jobs):
                results.append(result)
                bar.update(len(result[0]))
        _WORKER_ENCODER = None
    else:
        results = []
        for rows, wheres in jobs:
            results.append(encoder.encode(rows, wheres))
            bar.update(len(rows))
    bar.close()
    ids = [np.asarray(x, dtype=np.int32) for batch_ids, _ in results for x in batch_ids]
    masks = [m for _, batch_masks in results for m in batch_masks]
    return _flatten(ids, masks, encoder.max_seq_length)


def _flatten(ids: list[np.ndarray], masks: list[np.ndarray], max_seq_length: int | None) -> TokenizedSplit:
    """Per-sample arrays -> a :class:`TokenizedSplit`, truncated to ``max_seq_length`` and loss-free samples dropped."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    truncated = lengths > max_seq_length if max_seq_length is not None else np.zeros(len(ids), dtype=bool)
    if truncated.any():
        ids = [x[:max_seq_length] for x in ids]
        masks = [m[:max_seq_length] for m in masks]
        lengths = np.minimum(lengths, max_seq_length)
    has_loss = np.fromiter((m.any() for m in masks), dtype=bool, count=len(masks))
    keep = np.flatnonzero(has_loss)
    offsets = np.concatenate(([0], np.cumsum(lengths[keep]))).astype(np.int64)
    split = TokenizedSplit(
        tokens=np.concatenate([ids[i] for i in keep]) if keep.size else np.zeros(0, np.int32),
        loss_mask=np.concatenate([masks[i] for i in keep]) if keep.size else np.zeros(0, np.uint8),
        offsets=offsets, source_index=keep.astype(np.int64),
    )
    split.num_truncated = int(truncated[keep].sum())
    split.num_dropped = int((~has_loss).sum())
    return split


def _worker_count(num_proc: int, rows: int, log: Callable[[str], None]) -> int:
    """How many processes to tokenise with; says why when ``num_proc`` cannot help."""
    if num_proc <= 1:
        return 1
    cores = os.cpu_count() or 1
    note = (f"--num-proc {num_proc}: the fast tokenizer already encodes every batch on all {cores} cores, so extra "
            "processes only spread the Python-side rendering (chat templates)")
    if rows < MIN_ROWS_PER_PROCESS * 2:
        log(f"{note}; with {rows} rows a worker costs more to start than it saves: tokenising in this process")
        return 1
    workers = min(num_proc, cores, rows // MIN_ROWS_PER_PROCESS)
    log(f"{note}; using {workers} worker processes" + (f" (capped at {cores} cores)" if num_proc > cores else ""))
    return workers


_WORKER_ENCODER: SampleEncoder | None = None


def _quiet_tokenizer() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core: no nested thread pools


def _encode_job(job: tuple[list[dict], list[str]]):
    return _WORKER_ENCODER.encode(*job)
