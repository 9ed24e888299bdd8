"""Offline packing, tokenisation: records -> token ids + loss mask, with the label spans taken from the rendering.

Formats (TRL's dataset types, detected from the first record with ``auto``; docs/data_formats.md):

* ``chat`` (conversational ``messages``): the tokenizer's own chat template (or ``chat_template``), tokens exactly
  as ``apply_chat_template`` gives them (every message field, the row's ``tools``); assistant spans from its
  ``{% generation %}`` blocks, TRL's training variant of it, the rendered text's markup, per-message sentinels or
  prefix renderings (``vlm_pack.data.chat_template``), mapped onto tokens by the fast tokenizer's offsets. Labels never come from searching the
  reply's text, so a reply that also occurs in the prompt, in a system prompt or in an earlier turn is labelled
  where the assistant said it. Conversational prompt-completion records (``prompt`` and ``completion`` lists of
  messages) are the chat ``prompt + completion``, labelled on the completion's assistant turns only (TRL's
  ``completion_only_loss``); with ``chat`` given explicitly, string prompt / completion (or response) pairs become
  a user and an assistant message.
* ``prompt_completion`` (string ``prompt`` / ``completion``): as TRL's ``SFTTrainer`` tokenises them: the
  tokenizer on ``prompt`` and on ``prompt + completion`` (+ EOS when the completion does not end with it), special
  tokens added; labels on the tokens after the two's common prefix (TRL's ``completion_only_loss`` default).
* ``text`` (language modelling): the tokenizer on ``text`` (+ EOS when absent), special tokens added, EVERY
  token labelled, as ``SFTTrainer`` trains a ``text`` dataset.
* ``alpaca`` (``prompt`` / ``response``): ``<bos>`` + an instruction header around the prompt + response +
  ``<eos>``, the response's character span known by construction and mapped onto tokens by the fast tokenizer's
  offsets.
* ``auto`` (default): from the first record (:meth:`SampleFormat.detect`).

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

TEMPLATES = ("auto", "alpaca", "chat", "prompt_completion", "text")
FORMATS_RULE = "trl-formats-1"  # how records become samples; part of the token-cache key (prepare.token_keys)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{prompt}\n\n### Response:\n"
)
# Private record key: how many assistant turns at the end of a chat are the completion of a prompt-completion record.
COMPLETION_TURNS = "vlm_pack_completion_turns"
BATCH_ROWS = 1000  # rows per tokenizer call: the fast tokenizer encodes a batch on all cores
MIN_ROWS_PER_PROCESS = 5000  # below this a worker process costs more to start than it saves


@dataclass(frozen=True)
class SampleFormat:
    """How records are read and rendered."""

    template: str = "auto"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    completion_field: str = "completion"
    text_field: str = "text"

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")

    def detect(self, first: Any) -> str | None:
        """The format of a record, in TRL's order: prompt + completion (``chat`` when the prompt is a list of
        messages, else ``prompt_completion``), ``messages`` (``chat``), prompt + response (``alpaca``), ``text``."""
        if not isinstance(first, dict):
            return None
        has = {name for name, value in first.items() if value is not None}
        if {self.prompt_field, self.completion_field} <= has:
            return "chat" if isinstance(first[self.prompt_field], list) else "prompt_completion"
        if self.messages_field in has and self.prompt_field not in has:
            return "chat"
        if {self.prompt_field, self.response_field} <= has:
            return "alpaca"
        if self.text_field in has:
            return "text"
        if self.completion_field in has:  # partial records: ``check`` names the missing field
            return "prompt_completion"
        return "alpaca" if {self.prompt_field, self.response_field} & has else None

    def resolved(self, first: Any, where: str = "the first record") -> "SampleFormat":
        """``auto`` -> the detected format of the first record; ``prompt_completion`` on conversational records ->
        ``chat`` (their ``prompt + completion`` is a chat)."""
        if self.template == "prompt_completion" and isinstance(first, dict) and isinstance(
                first.get(self.prompt_field), list):
            return replace(self, template="chat")
        if self.template != "auto":
            return self
        detected = self.detect(first)
        if detected is None:
            present = ", ".join(sorted(k for k, v in first.items() if v is not None)) if isinstance(first, dict) else (
                f"a {type(first).__name__}, not an object")
            fields = (f"{self.messages_field!r} (conversational), {self.prompt_field!r} + {self.completion_field!r} "
                      f"(prompt-completion), {self.text_field!r} (language modelling) or {self.prompt_field!r} + "
                      f"{self.response_field!r} (alpaca)")
            raise ValueError(f"{where}: no known dataset format (present: {present}); records need {fields}. Name "
                             "other fields with --messages-field / --prompt-field / --completion-field / --text-field "
                             "/ --response-field")
        return replace(self, template=detected)

    def as_chat(self, record: Any, where: str) -> Any:
        """A ``chat`` record without a messages list but with a prompt and a completion (or response), as a
        messages record: conversational ``prompt + completion`` (its completion's assistant turns counted under
        :data:`COMPLETION_TURNS`, so only the completion is labelled), or strings as a user and an assistant
        message. Anything else is returned as is (``check`` names what is wrong)."""
        if not isinstance(record, dict) or record.get(self.messages_field) is not None:
            return record
        prompt = record.get(self.prompt_field)
        answer_field = self.completion_field if record.get(self.completion_field) is not None else self.response_field
        answer = record.get(answer_field)
        if prompt is None or answer is None:
            return record
        rest = {k: v for k, v in record.items() if k not in (self.prompt_field, self.completion_field,
                                                               self.response_field)}
        if isinstance(prompt, str) and isinstance(answer, str):
            return {**rest, self.messages_field: [{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": answer}]}
        for name, value in ((self.prompt_field, prompt), (answer_field, answer)):
            if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
                raise ValueError(f"{where}: field {name!r} must be a list of messages ({{role, content}}) like "
                                 f"the first record's, got {type(value).__name__}; give every record the same format")
        if not any(m.get("role") == "assistant" for m in answer):
            raise ValueError(f"{where}: field {answer_field!r} has no assistant message, so nothing to train on; "
                             "the completion holds the assistant's reply")
        turns = sum(m.get("role") == "assistant" for m in answer)
        return {**rest, self.messages_field: [*prompt, *answer], COMPLETION_TURNS: turns}

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
            from ..data.chat_template import ANSWER_FIELDS, check_role

            for turn, message in enumerate(messages):
                check_role(message["role"], f"{where}, turn {turn}")
            answers = [m for m in messages if m["role"] == "assistant"]
            if not answers:
                raise ValueError(f"{where}: {self.messages_field!r} has no assistant message, so nothing to train on")
            if not any((m.get("content") or "").strip() or any(m.get(k) for k in ANSWER_FIELDS) for m in answers):
                raise ValueError(f"{where}: empty response (no assistant message has content); fill or drop it")
            tools = record.get("tools")
            if tools is not None and not isinstance(tools, (list, str)):
                raise ValueError(f"{where}: field 'tools' must be a list of function schemas")
            return
        self._check_strings(record, where)

    def _check_strings(self, record: dict, where: str) -> None:
        """The string fields of the ``alpaca``, ``prompt_completion`` and ``text`` formats."""
        answer = {"prompt_completion": self.completion_field, "text": None}.get(self.template, self.response_field)
        fields = [(self.text_field, "--text-field")] if self.template == "text" else [
            (self.prompt_field, "--prompt-field"),
            (answer, "--completion-field" if answer == self.completion_field else "--response-field")]
        for name, flag in fields:
            if record.get(name) is None:
                present = ", ".join(sorted(k for k, v in record.items() if v is not None))
                chat = f" or a {self.messages_field!r} list with --template chat" if self.template == "alpaca" else ""
                raise ValueError(
                    f"{where}: missing field {name!r} (present: {present}); name the right field with {flag}{chat}"
                )
            if not isinstance(record[name], str):
                raise ValueError(f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}")
        last = fields[-1][0]
        if not record[last].strip():
            what = "text" if self.template == "text" else "response"
            raise ValueError(f"{where}: empty {what} in field {last!r}; fill or drop the sample")


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
        elif self.fmt.template == "prompt_completion":
            ids, masks = self._prompt_completion(rows)
        elif self.fmt.template == "text":
            ids, masks = self._text(rows)
        else:
            ids, masks = self._chat(rows, wheres)
            masks = [_completion_only(mask, row.get(COMPLETION_TURNS)) for mask, row in zip(masks, rows)]
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

    def _with_eos(self, text: str) -> str:
        eos = self.tokenizer.eos_token
        return text if not eos or text.endswith(eos) else text + eos

    def _prompt_completion(self, rows: list[dict]) -> tuple[list[list[int]], list[np.ndarray]]:
        """TRL's SFTTrainer on string prompt-completion records: tokens of ``prompt + completion`` (+ EOS), labels
        after the common prefix with the prompt's own tokens (module doc)."""
        tok, fmt = self.tokenizer, self.fmt
        prompts = [r[fmt.prompt_field] for r in rows]
        texts = [p + self._with_eos(r[fmt.completion_field]) for p, r in zip(prompts, rows)]
        heads = tok(prompts, verbose=False)["input_ids"]
        ids = tok(texts, verbose=False)["input_ids"]
        masks = []
        for head, full in zip(heads, ids):
            n = min(len(head), len(full))
            differ = np.flatnonzero(np.asarray(head[:n]) != np.asarray(full[:n]))
            mask = np.ones(len(full), dtype=np.uint8)
            mask[:int(differ[0]) if differ.size else n] = 0
            masks.append(mask)
        return ids, masks

    def _text(self, rows: list[dict]) -> tuple[list[list[int]], list[np.ndarray]]:
        """TRL's SFTTrainer on ``text`` records: the tokenizer on text (+ EOS), every token labelled."""
        ids = self.tokenizer([self._with_eos(r[self.fmt.text_field]) for r in rows], verbose=False)["input_ids"]
        return ids, [np.ones(len(x), dtype=np.uint8) for x in ids]

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


def _completion_only(mask: np.ndarray, completion_turns: int | None) -> np.ndarray:
    """A chat's mask kept on its last ``completion_turns`` labelled spans only (the completion of a conversational
    prompt-completion record; assistant turns inside its prompt are context, as in TRL)."""
    if completion_turns is None:
        return mask
    starts = np.flatnonzero(np.diff(np.concatenate(([0], mask))) == 1)
    if len(starts) > completion_turns:
        mask[:starts[-completion_turns]] = 0
    return mask


def check_records(records: Records, fmt: SampleFormat) -> SampleFormat:
    """Resolve ``auto`` from the first record and check every record; returns the resolved format. Chat records
    given as a prompt and a completion become messages records in place (:meth:`SampleFormat.as_chat`)."""
    fmt = fmt.resolved(records.rows[0] if records.rows else None, records.where(0) if records.rows else "input")
    rows = records.rows
    for i, row in enumerate(rows):
        where = records.where(i)
        if fmt.template == "chat":
            row = rows[i] = fmt.as_chat(row, where)
        fmt.check(row, where)
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
