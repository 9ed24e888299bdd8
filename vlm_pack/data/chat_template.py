"""The model's own chat template, and where its assistant turns are (no torch: the offline path keys caches on it).

Tokens are always those of the model's OWN template (or the caller's ``chat_template=``): exactly what
``processor.apply_chat_template(..., tools=..., tokenize=True)`` gives, so fine-tuning sees the format used at
inference. Every message field the template reads is passed through (reasoning, tool calls, tool responses,
names), an example's ``tools`` as ``tools=``, and chat-level ``template_kwargs`` (e.g. ``enable_thinking``).
Labels need the assistant spans; they come from the template's own ``{% generation %}`` blocks, else, per
sample, from TRL's training variant of that exact template, the rendered text's markup, edge-whitespace
sentinels, prefix renderings or, for text beside tool calls that the template moves, insertions
(:func:`locate_turns`), each proven against the template's own rendering of that sample. The template is tried
on probe chats when a collator / ``prepare`` is built: a feature no method can label is refused there, naming
it. See ``docs/chat_templates.md``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import itertools
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ACCEPTED_ROLES",
    "ANSWER_FIELDS",
    "RENDERING_RULE",
    "CHATML_TEMPLATE",
    "ChatTemplate",
    "check_role",
    "takes_media",
    "example_tools",
    "locate_turns",
    "render_texts",
    "render_with_assistant_masks",
    "resolve_chat_template",
]

# Names how tokens and spans are chosen (module doc); part of the offline token-cache key, so caches written under
# another rule (e.g. the former ChatML fallback) are never reused. Change it whenever the rule changes.
RENDERING_RULE = ("own template, every message field and tools; spans from generation blocks, TRL's training "
                  "variant (+ its stop tag), markup, edge-whitespace sentinels, prefix renderings (a partial "
                  "header), text beside tool calls as insertions (v3)")
# Roles a conversation may use; anything else (e.g. "Assistant") is a typo that would silently drop labels.
ACCEPTED_ROLES = ("system", "user", "assistant", "tool")
# Message fields that make an assistant turn something to train on besides its content.
ANSWER_FIELDS = ("tool_calls", "reasoning_content", "thinking", "reasoning")

# ChatML with Qwen-VL vision markers; assistant turns (content + <|im_end|>) sit inside a generation block. Kept
# for the offline tiny processors of families whose official template no installed package ships. Newlines are
# emitted as expressions because HF renders templates with trim_blocks=True, which would eat a literal newline
# that follows a tag.
CHATML_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ render(message['content']) }}{{ '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}{{ render(message['content']) }}{{ '<|im_end|>' }}"
    "{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# The jinja tag HF uses to record assistant spans ("add_generation_prompt" must not count).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Writes a conversation's precomputed plain rendering piece by piece, assistant spans inside generation blocks.
_PIECES_KEY = "vlm_pack_pieces"
_PIECES_TEMPLATE = (
    "{%- for piece in messages[0]['" + _PIECES_KEY + "'] -%}"
    "{%- if piece[1] -%}{% generation %}{{ piece[0] }}{% endgeneration %}{%- else -%}{{ piece[0] }}{%- endif -%}"
    "{%- endfor -%}"
)
# Private-use characters: never in real text, never touched by a template's string filters.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile("\ue000(\\d+)([se])\ue001")


@dataclass(frozen=True)
class ChatTemplate:
    """The template a collator / ``prepare`` renders with and how it finds the assistant spans.

    ``template``: the template whose rendering is tokenised (the model's own or the caller's). ``marked``: a
    template with ``{% generation %}`` blocks expected to render the same text (``template`` itself, or TRL's
    training variant of it); None without one. ``name``: how errors name the template. ``prompt`` /
    ``terminator``: what the template writes before an assistant message's text (``add_generation_prompt``) and
    after it, for the sentinel and prefix methods (empty when a probe cannot read them). ``kwargs``: chat-level
    template variables passed to every rendering (e.g. ``enable_thinking``).
    """

    template: str
    marked: str | None
    name: str
    prompt: str = ""
    terminator: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    markup_error: str = ""


def with_prefix(processor: Any, chat: ChatTemplate, prefix: str) -> ChatTemplate:
    """``chat`` writing ``prefix`` first where its rendering does not start with it already.

    For processors that put ``prefix`` before every rendered chat AFTER ``apply_chat_template`` has recorded the
    assistant spans (``EncodingRules.template_prefix``: Molmo2Processor's BOS), which shifts every span by its length:
    written by the template instead, the processor adds nothing, the tokens are the same and the spans line up."""
    probe = [{"role": "user", "content": _probe_content(processor, "Hi")},
             {"role": "assistant", "content": _probe_content(processor, "Hello.")}]
    if render_texts(processor, [probe], chat.template, None, chat.kwargs)[0][0].startswith(prefix):
        return chat
    head = "{% raw %}" + prefix + "{% endraw %}"
    return replace(chat, template=head + chat.template, marked=None if chat.marked is None else head + chat.marked)


def takes_media(processor: Any) -> bool:
    """``processor`` is a multimodal processor (content as parts, media expanded by its ``__call__``), not a text
    tokenizer: it has an image processor or an audio feature extractor (Qwen2-Audio has no image processor)."""
    return hasattr(processor, "image_processor") or hasattr(processor, "feature_extractor")


def check_role(role: Any, where: str) -> None:
    """Refuse a role outside :data:`ACCEPTED_ROLES` (a misspelled one would silently lose its labels)."""
    if role not in ACCEPTED_ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; accepted roles: {', '.join(ACCEPTED_ROLES)}")


def example_tools(example: Any, index: int) -> list | None:
    """The example's chat-level ``tools`` (TRL's dataset column: function schemas handed to the chat template as
    ``tools=``), or None."""
    tools = example.get("tools") if isinstance(example, Mapping) else None
    if tools is None:
        return None
    if isinstance(tools, str):  # datasets often store the schemas as a JSON string
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise ValueError(f"sample {index}: 'tools' is a string that is not JSON ({exc})") from None
    if not isinstance(tools, Sequence) or not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError(f"sample {index}: 'tools' must be a list of function schemas (dicts); got {tools!r:.120}")
    return [dict(tool) for tool in tools] or None


# Variables the renderer itself sets: a chat-level kwarg must not override them.
_RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                    "return_assistant_tokens_mask", "tokenize", "chat_template")


def resolve_chat_template(
    processor: Any, chat_template: str | None = None, template_kwargs: Mapping[str, Any] | None = None
) -> ChatTemplate:
    """The caller's template, else the processor's own; with the way its assistant spans are found (module doc).

    ``template_kwargs``: chat-level template variables (e.g. ``{"enable_thinking": False}``) passed to every
    rendering; each must be a variable the template reads. The template is tried on probe chats (a single turn,
    edge whitespace, reasoning, tool calls): a feature it renders but whose assistant turns no method locates is
    refused here, naming the feature, not in the middle of training."""
    if chat_template is not None:
        template, name = chat_template, "the chat_template passed in"
    else:
        template = getattr(processor, "chat_template", None)
        if isinstance(template, Mapping):
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise ValueError(
                f"{type(processor).__name__} has no chat template: pass chat_template=... (the model's template, "
                "e.g. from its tokenizer_config.json / chat_template.jinja)"
            )
        name = f"the chat template of {type(processor).__name__}"
    kwargs = dict(template_kwargs or {})
    for key in kwargs:
        if key in _RESERVED_KWARGS:
            raise ValueError(f"template_kwargs: {key!r} is set by the renderer itself; give tools per example "
                             "(an example's 'tools' field)" if key == "tools" else
                             f"template_kwargs: {key!r} is set by the renderer itself; remove it")
        if not re.search(rf"\b{re.escape(key)}\b", template):
            raise ValueError(f"template_kwargs: {name} never reads {key!r}, so it would change nothing; remove it")
    marked = template if _GENERATION_TAG.search(template) else _trl_training_variant(template)
    chat = ChatTemplate(template, marked, name, kwargs=kwargs)
    try:
        prompt, terminator = _turn_markup(processor, chat)
        chat = replace(chat, prompt=prompt, terminator=terminator)
    except _NoPrompt:
        if marked is None:  # nothing says where an answer begins
            raise
    except ValueError as exc:  # no sentinels; the other methods may still prove the turns
        chat = replace(chat, markup_error=str(exc).split("label masking: ", 1)[-1].split(". Pass chat_template")[0])
    _dry_run(processor, chat)
    return chat


def _trl_training_variant(template: str) -> str | None:
    """TRL's training variant of ``template``: what ``trl.chat_template_utils.get_training_chat_template`` returns
    for it (TRL ships each official template ``X.jinja`` it patches beside its variant ``X_training.jinja`` and
    matches the template text exactly), read from the installed package's files without importing TRL (its import
    pulls in torch and the model code: 20 s of a cold ``prepare`` on a loaded machine)."""
    return _trl_variants().get(template)


@functools.lru_cache(maxsize=1)
def _trl_variants() -> dict[str, str]:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return {}
    variants = {}
    for path in (pathlib.Path(spec.origin).parent / "chat_templates").glob("*_training.jinja"):
        original = path.with_name(path.name.removesuffix("_training.jinja") + ".jinja")
        if original.is_file():
            variant = path.read_text(encoding="utf-8")
            if _GENERATION_TAG.search(variant):
                variants[original.read_text(encoding="utf-8")] = variant
    return variants


# ----------------------------------------------------------------------------------------------- rendering


def render_texts(
    processor: Any, conversations: list[list[dict]], template: str, tools: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None, *, add_generation_prompt: bool = False, marks: bool = False,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """``apply_chat_template(..., tokenize=False)`` of each conversation (with its own ``tools``): the texts, and with
    ``marks`` the character spans of the template's ``{% generation %}`` blocks. Renders as transformers does
    (the tokenizer's special tokens as variables, messages without their None-valued fields), without tokenising."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tokenizer = getattr(processor, "tokenizer", processor)
    variables = {**tokenizer.special_tokens_map, **(kwargs or {})}
    tools = list(tools) if tools is not None else [None] * len(conversations)
    texts: list[str] = [""] * len(conversations)
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    groups: dict[str, list[int]] = {}
    for index, chat_tools in enumerate(tools):  # one call per distinct tools list (usually one)
        groups.setdefault(_tools_key(chat_tools), []).append(index)
    for rows in groups.values():
        chats = [[{k: v for k, v in m.items() if v is not None} for m in conversations[i]] for i in rows]
        rendered, indices = render_jinja_template(
            conversations=chats, tools=tools[rows[0]], chat_template=template, return_assistant_tokens_mask=marks,
            add_generation_prompt=add_generation_prompt, **variables,
        )
        for row, text, found in zip(rows, rendered, indices if marks else [[]] * len(rows)):
            texts[row], spans[row] = text, [(int(a), int(b)) for a, b in found]
    return texts, spans


def _tools_key(tools: Any) -> str:
    if tools is None:
        return ""
    return json.dumps(tools, sort_keys=True, default=repr)


def render_with_assistant_masks(
    processor: Any, conversations: list[list[dict]], chat: ChatTemplate, tools: Sequence[Any] | None = None,
    **kwargs: Any,
) -> Mapping[str, Any]:
    """``processor.apply_chat_template(conversations, tools=..., tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True, **kwargs)``: tokens of ``chat.template``'s rendering (plus the final
    turn's stop tag where TRL's training variant adds one, :func:`locate_turns`) and masks on the assistant
    spans."""
    located = locate_turns(processor, conversations, chat, tools)
    texts = [text for text, _ in located]
    spans = [text_spans for _, text_spans in located]
    if not kwargs.keys() - {"tokenizer_kwargs"} and not takes_media(processor):
        return _tokenize_spans(processor, texts, spans, kwargs.get("tokenizer_kwargs") or {})
    pieced = []
    for conversation, text, text_spans in zip(conversations, texts, spans):
        pieces, start = [], 0
        for begin, end in text_spans:
            pieces += [(text[start:begin], False), (text[begin:end], True)]
            start = end
        pieces.append((text[start:], False))
        pieced.append([{**conversation[0], _PIECES_KEY: pieces}, *conversation[1:]])
    return processor.apply_chat_template(
        pieced, chat_template=_PIECES_TEMPLATE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        **kwargs,
    )


def locate_turns(
    processor: Any, conversations: list[list[dict]], chat: ChatTemplate, tools: Sequence[Any] | None = None,
) -> list[tuple[str, list[tuple[int, int]]]]:
    """(text, assistant character spans) of each conversation; fails closed with a ``ValueError`` naming the sample.

    The text is ``chat.template``'s rendering. Spans come from the template's own ``{% generation %}`` blocks if it
    has them; else, per sample, from the first of these methods that proves them:

    1. TRL's training variant, where it renders the same text (TRL chose where its turns begin: Qwen2.5's after
       ``<|im_start|>assistant``, before the newline); or the same text plus a tail inside the final assistant
       span (GLM-4-MoE has no end-of-turn token: the variant labels the next turn's opening tag, and on the final
       turn appends it; the tail then joins the text, the one place tokens go beyond the template's);
    2. the rendered text's markup (:func:`_markup_spans`): where the turn header and terminator hold special
       tokens and no string of the chat does, one header per assistant message, each closed by its terminator;
       no extra rendering;
    3. per-message sentinels placed inside the message's edge whitespace (a template that strips or trims it
       renders the same text once they are removed); the span runs from the end of the turn header to the end
       of the template's terminator;
    4. prefix renderings: the turn starts at the end of its header in ``render(messages[:i],
       add_generation_prompt=True)`` and ends where ``render(messages[:i + 1])`` ends, when that is a prefix of
       the whole rendering (as TRL's prefix-preservation check demands); where it is not (Qwen3 writes a think
       block on the final turn only), at the first end-of-turn terminator after the header, provided that
       terminator holds a special token (no text writes one). Where the turn repeats only the start of the
       generation prompt (DeepSeek), the header is the longest part of it ending a whole tag
       (:func:`_shared_header_end`);
    5. for assistant messages with text beside their tool calls that no method above locates (Gemma 4 writes the
       text after the tool responses, inside the turn): the chat with that text emptied, located as above, plus
       the text's own insertions (:func:`_beside_call_spans`).
    """
    tools = list(tools) if tools is not None else [None] * len(conversations)
    plain, own = _checked_render(processor, conversations, chat.template, tools, chat.kwargs,
                                 marks=chat.marked == chat.template)
    if chat.marked == chat.template:
        return list(zip(plain, own))
    located: list[tuple[str, list[tuple[int, int]]] | None] = [None] * len(conversations)
    reasons: dict[int, list[str]] = {index: [] for index in range(len(conversations))}
    if chat.marked is not None:
        try:
            texts, spans = render_texts(processor, conversations, chat.marked, tools, chat.kwargs, marks=True)
        except Exception:  # the variant fails on this batch: the other methods decide
            texts, spans = [None] * len(conversations), [[]] * len(conversations)
        for index, (text, variant, found) in enumerate(zip(plain, texts, spans)):
            if variant == text or (variant is not None and variant.startswith(text) and found
                                   and found[-1][0] <= len(text) and found[-1][1] == len(variant)):
                located[index] = (variant, found)
            else:
                reasons[index].append("TRL's training variant renders it differently")
    pending = [index for index, done in enumerate(located) if done is None]
    special = _special_pattern(processor) if pending and chat.terminator else None
    for index in pending if special is not None else ():
        spans = _markup_spans(conversations[index], tools[index], plain[index], chat, special)
        located[index] = None if spans is None else (plain[index], spans)
    pending = [index for index, done in enumerate(located) if done is None]
    if pending and chat.terminator:
        marked_chats = [_with_sentinels(conversations[index]) for index in pending]
        try:
            marked_texts, _ = render_texts(processor, marked_chats, chat.template, [tools[i] for i in pending],
                                           chat.kwargs)
        except Exception:
            marked_texts = [None] * len(pending)
        for index, text in zip(pending, marked_texts):
            try:
                if text is None:
                    raise ValueError("the template fails on the marked messages")
                located[index] = (plain[index], _sentinel_spans(conversations[index], plain[index], text, chat))
            except ValueError as exc:
                reasons[index].append(str(exc))
    elif pending:
        for index in pending:
            reasons[index].append(chat.markup_error or "the template's turn markup could not be read off a probe")
    pending = [index for index, done in enumerate(located) if done is None]
    for index in [i for i in pending if located[i] is None]:
        try:
            located[index] = (plain[index], _prefix_spans(processor, conversations[index], chat, tools[index],
                                                          plain[index]))
        except ValueError as exc:
            reasons[index].append(str(exc))
            try:
                located[index] = (plain[index], _beside_call_spans(processor, conversations[index], chat,
                                                                   tools[index], plain[index]))
            except ValueError as why:
                if str(why):
                    reasons[index].append(str(why))
                raise _unlocatable(chat, "; ".join(reasons[index]), f"sample {index}") from None
    return located  # type: ignore[return-value]


def _checked_render(processor, conversations, template, tools, kwargs, marks):
    """:func:`render_texts`; a failure names the first sample the template refuses."""
    try:
        return render_texts(processor, conversations, template, tools, kwargs, marks=marks)
    except Exception as batch_error:
        for index, conversation in enumerate(conversations):
            try:
                render_texts(processor, [conversation], template, [tools[index]], kwargs)
            except Exception as exc:
                raise ValueError(f"sample {index}: the chat template cannot render it ({type(exc).__name__}: "
                                 f"{exc})") from exc
        raise batch_error


def _tokenize_spans(
    tokenizer: Any, texts: list[str], spans: list[list[tuple[int, int]]], tokenizer_kwargs: Mapping[str, Any]
) -> dict[str, list]:
    """What ``apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)`` returns for ``texts``
    already rendered (a tokenizer, no media): the same tokens (``add_special_tokens=False``) and the same mask rule
    (a token is marked when it overlaps a span), the mask computed from the offsets in one vectorised pass instead
    of a third rendering through the pieces template and a Python loop over every token."""
    import numpy as np

    out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, **tokenizer_kwargs)
    masks = []
    for offsets, text_spans in zip(out["offset_mapping"], spans):
        offsets = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
        offsets = offsets.reshape(-1, 2)
        bounds = np.asarray(text_spans, dtype=np.int64).reshape(-1, 2)
        # the first span ending after the token starts; the token overlaps it when it ends after that span starts
        span = np.searchsorted(bounds[:, 1], offsets[:, 0], side="right")
        inside = span < len(bounds)
        mask = np.zeros(len(offsets), dtype=np.uint8)
        mask[inside] = offsets[inside, 1] > bounds[span[inside], 0]
        masks.append(mask)
    return {"input_ids": out["input_ids"], "assistant_masks": masks}


def _render_one(processor: Any, conversation: list[dict], chat: ChatTemplate, tools: Any = None,
                add_generation_prompt: bool = False) -> str:
    texts, _ = render_texts(processor, [conversation], chat.template, [tools], chat.kwargs,
                            add_generation_prompt=add_generation_prompt)
    return texts[0]


def _turn_markup(processor: Any, chat: ChatTemplate) -> tuple[str, str]:
    """(generation prompt, assistant-turn terminator) of ``chat.template``, read off a two-turn probe."""
    user = [{"role": "user", "content": _probe_content(processor, "Hi")}]
    try:
        bare = _render_one(processor, user, chat)
        prompt = _render_one(processor, user, chat, add_generation_prompt=True)
        answered = _render_one(
            processor, user + [{"role": "assistant", "content": _probe_content(processor, f"Yes{_mark(0, 'e')}")}],
            chat,
        )
    except Exception as exc:
        raise _unlocatable(chat, f"it cannot render a probe conversation ({type(exc).__name__}: {exc})") from exc
    if not prompt.startswith(bare) or len(prompt) == len(bare):
        error = _unlocatable(chat, "add_generation_prompt=True adds no assistant prompt after the conversation")
        raise _NoPrompt(str(error))
    if answered.count(_mark(0, "e")) != 1:
        raise _unlocatable(chat, "it does not write an assistant message's text as given")
    return prompt[len(bare):], answered.split(_mark(0, "e"))[1]


class _NoPrompt(ValueError):
    """The template writes no generation prompt: nothing tells where an assistant turn begins."""


def _probe_content(processor: Any, text: str | None) -> Any:
    return [{"type": "text", "text": text}] if text is not None and takes_media(processor) else text


def _probe_call(word: str, json_arguments: bool) -> dict:
    arguments = {"word": word}
    return {"type": "function", "id": "c1", "function": {
        "name": "lookup", "arguments": json.dumps(arguments) if json_arguments else arguments}}


# Probe chats of the construction-time dry run: (template feature, messages, tools). Each is tried only when the
# template renders it (many templates refuse a system turn or tool messages themselves).
_PROBE_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
_PROBES = (
    ("a single turn", [("user", "Hi"), ("assistant", "Hello.")], None),
    ("a system turn and several turns", [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."),
                                         ("user", "Again"), ("assistant", "Bye.")], None),
    ("an answer with a leading newline and trailing spaces", [("user", "Hi"), ("assistant", "\nHello.  "),
                                                              ("user", "More"), ("assistant", " Yes ")], None),
    ("a whitespace-only answer", [("user", "Hi"), ("assistant", "  "), ("user", "Now"), ("assistant", "Ok.")], None),
    ("reasoning (reasoning_content)", [("user", "Hi"), ("assistant", "Hello.", {"reasoning_content": "Greet.\n"}),
                                       ("user", "More"), ("assistant", "\nYes.", {"reasoning_content": "Agree."})],
     None),
    ("reasoning (thinking)", [("user", "Hi"), ("assistant", "Hello.", {"thinking": "Greet."}), ("user", "More"),
                              ("assistant", "Yes.", {"thinking": "Agree."})], None),
    ("reasoning (reasoning)", [("user", "Hi"), ("assistant", "Hello.", {"reasoning": "Greet."}), ("user", "More"),
                               ("assistant", "Yes.", {"reasoning": "Agree."})], None),
    ("an answer that is reasoning only", [("user", "Hi"), ("assistant", "", {"reasoning_content": "Nothing to say."}),
                                          ("user", "More"), ("assistant", "Yes.")], None),
    ("reasoning inside the content (<think>...</think>)", [
        ("user", "Hi"), ("assistant", "<think>\nGreet.\n</think>\n\nHello."), ("user", "More"),
        ("assistant", "<think>\nAgree.\n</think>\n\nYes.")], None),
    ("tool calls and tool responses", [
        ("user", "Define cat."),
        ("assistant", "", {"tool_calls": [_probe_call("cat", json_arguments=False)]}),
        ("tool", "A small feline.", {"tool_call_id": "c1", "name": "lookup"}),
        ("assistant", "A cat is a small feline.")], _PROBE_TOOLS),
    ("tool calls without content (None)", [
        ("user", "Define cat."), ("assistant", None, {"tool_calls": [_probe_call("cat", json_arguments=False)]}),
        ("tool", "A small feline.", {"tool_call_id": "c1", "name": "lookup"}), ("assistant", "A small feline.")],
     _PROBE_TOOLS),
    # DeepSeek's templates concatenate the arguments as a string (a dict makes them fail): two rounds, as the
    # second round's call is written without a header
    ("tool calls with JSON-string arguments, in two rounds", [
        ("user", "Define cat."), ("assistant", "", {"tool_calls": [_probe_call("cat", json_arguments=True)]}),
        ("tool", "A small feline.", {"tool_call_id": "c1", "name": "lookup"}), ("assistant", "A small feline."),
        ("user", "And dog?"), ("assistant", "", {"tool_calls": [_probe_call("dog", json_arguments=True)]}),
        ("tool", "A canine.", {"tool_call_id": "c1", "name": "lookup"}), ("assistant", "A canine.")], _PROBE_TOOLS),
    ("tools offered but not called", [("user", "Hi"), ("assistant", "Hello.")], _PROBE_TOOLS),
    ("text beside tool calls", [
        ("user", "Define cat."),
        ("assistant", "Let me look.", {"tool_calls": [_probe_call("cat", json_arguments=False)]}),
        ("tool", "A small feline.", {"tool_call_id": "c1", "name": "lookup"}), ("assistant", "A small feline.")],
     _PROBE_TOOLS),
)


def _dry_run(processor: Any, chat: ChatTemplate) -> None:
    """Locate the assistant turns of each probe chat the template renders; refuse the template, naming the
    feature, where none of the methods of :func:`locate_turns` can."""
    for feature, turns, tools in _PROBES:
        messages = [{"role": role, "content": _probe_content(processor, text), **(extra[0] if extra else {})}
                    for role, text, *extra in turns]
        try:
            render_texts(processor, [messages], chat.template, [tools], chat.kwargs)
        except Exception:
            continue  # the template itself refuses such chats: nothing to label
        try:
            locate_turns(processor, [messages], chat, [tools])
        except ValueError as exc:
            raise ValueError(f"{chat.name} is refused for chats with {feature}: {exc}".replace("sample 0: ", ""))


def _mark(turn: int, side: str) -> str:
    return f"{_OPEN}{turn}{side}{_CLOSE}"


def _edges(text: str) -> tuple[str, str, str]:
    """(leading whitespace, core, trailing whitespace) of ``text``."""
    core = text.strip()
    if not core:
        return text, "", ""
    head = len(text) - len(text.lstrip())
    return text[:head], core, text[head + len(core):]


def _with_sentinels(conversation: list[dict]) -> list[dict]:
    """Each assistant message's text with its own start/end sentinels INSIDE its edge whitespace (first and last
    text part), so a template that strips or trims the text removes the same whitespace as without them."""
    marked = []
    for turn, message in enumerate(conversation):
        content = message.get("content")
        if message["role"] == "assistant" and content is not None:
            if isinstance(content, str):
                head, core, tail = _edges(content)
                content = head + _mark(turn, "s") + core + _mark(turn, "e") + tail
            else:
                texts = [i for i, part in enumerate(content) if part.get("type") == "text"]
                content = [dict(part) for part in content]
                if texts:
                    head, core, tail = _edges(content[texts[0]]["text"])
                    content[texts[0]]["text"] = head + _mark(turn, "s") + core + tail
                    head, core, tail = _edges(content[texts[-1]]["text"])
                    content[texts[-1]]["text"] = head + core + _mark(turn, "e") + tail
        marked.append({**message, "content": content} if content is not None else dict(message))
    return marked


def _special_pattern(processor: Any) -> re.Pattern | None:
    """A regex matching any multi-character special / added token of the processor's tokenizer (None if none)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    tokens = {token for token in getattr(tokenizer, "all_special_tokens", []) if len(token) > 1}
    tokens |= {token for token in getattr(tokenizer, "get_added_vocab", dict)() if len(token) > 1}
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def _strings(value: Any):
    """Every string inside a message / tools value (nested dicts and lists)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _markup_spans(conversation: list[dict], tools: Any, plain: str, chat: ChatTemplate,
                  special: re.Pattern) -> list[tuple[int, int]] | None:
    """Assistant spans read off the rendered text's own markup, None where that is not proven.

    Proven when the assistant header (the generation prompt's first line, see :func:`_prompt_end`) and the
    terminator each hold a special token and NO string of the chat or its tools holds one: every header and
    terminator in the text is then the template's own; the text must hold exactly one header per assistant
    message, each followed by its terminator before the next header. The span is what the sentinel method
    gives (header end to terminator end), at the cost of no extra rendering."""
    header = chat.prompt[:_header_cut(chat.prompt)]
    if not (special.search(header) and special.search(chat.terminator)):
        return None
    if any(special.search(text) for text in _strings(conversation)) or any(
            special.search(text) for text in _strings(tools)):
        return None
    starts, at = [], plain.find(header)
    while at >= 0:
        starts.append(at + len(header))
        at = plain.find(header, at + len(header))
    if len(starts) != sum(message["role"] == "assistant" for message in conversation):
        return None
    spans = []
    for k, start in enumerate(starts):
        end = plain.find(chat.terminator, start)
        if end < 0 or (k + 1 < len(starts) and end + len(chat.terminator) > starts[k + 1] - len(header)):
            return None
        spans.append((start, end + len(chat.terminator)))
    return spans


def _trailing_space(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if part.get("type") == "text"]
        content = texts[-1] if texts else ""
    return _edges(content)[2] if isinstance(content, str) else ""


def _sentinel_spans(conversation: list[dict], plain: str, marked: str, chat: ChatTemplate) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``plain`` given its rendering with sentinels ``marked`` (module
    doc, method 3); raises a ValueError saying why they cannot be trusted."""
    turns = [turn for turn, message in enumerate(conversation) if message["role"] == "assistant"]
    if _SENTINEL.sub("", marked) != plain:
        raise ValueError("marking an assistant message changes how the template renders it")
    found, removed = [], 0
    for match in _SENTINEL.finditer(marked):  # each sentinel's offset in the plain text
        found.append((int(match.group(1)), match.group(2), match.start() - removed))
        removed += match.end() - match.start()
    expected = [(turn, side) for turn in turns for side in "se"]
    if [(turn, side) for turn, side, _ in found] != expected:
        raise ValueError("it drops, repeats or reorders an assistant message's text")
    spans, floor = [], 0
    for (turn, _, start), (_, _, end) in zip(found[::2], found[1::2]):
        head = _prompt_end(plain, chat.prompt, floor, start)
        tail = _trailing_space(conversation[turn])
        if not plain.startswith(chat.terminator, end) and plain.startswith(tail + chat.terminator, end):
            end += len(tail)  # the template kept the message's trailing whitespace
        if head < 0 or not plain.startswith(chat.terminator, end):
            raise ValueError("an assistant message is not framed by the template's own prompt and terminator "
                             "(e.g. tool-call markup after its text)")
        spans.append((head, end + len(chat.terminator)))
        floor = spans[-1][1]
    return spans


def _prefix_spans(processor: Any, conversation: list[dict], chat: ChatTemplate, tools: Any,
                  plain: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``plain`` from prefix renderings (module doc, method 4)."""
    spans, floor = [], 0
    for turn, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        try:
            head = _render_one(processor, conversation[:turn], chat, tools, add_generation_prompt=True)
            upto = _render_one(processor, conversation[:turn + 1], chat, tools)
        except Exception as exc:
            raise ValueError(f"it cannot render the chat up to turn {turn} ({type(exc).__name__}: {exc})") from None
        shared = len(os.path.commonprefix([head, plain]))
        start = _prompt_end(plain, chat.prompt, floor, shared) if chat.prompt else -1
        if start < 0:
            start = shared if shared == len(head) else _shared_header_end(head, chat.prompt, floor, shared)
            if start < 0:
                raise ValueError(f"the generation prompt before assistant turn {turn} is not where the turn begins")
        if plain.startswith(upto):
            end = len(upto)
        elif _ends_with_special(processor, chat.terminator):
            # Not prefix-preserving (Qwen3 writes a think block on the last turn only): the turn ends at the first
            # end-of-turn terminator after its header, a special token no text writes.
            end = plain.find(chat.terminator, start)
            if end < 0:
                raise ValueError(f"assistant turn {turn} has no end-of-turn terminator {chat.terminator!r}")
            end += len(chat.terminator)
        else:
            raise ValueError(f"it is not prefix-preserving: it renders assistant turn {turn} differently once later "
                             "messages follow, and its turns end without an end-of-turn token")
        if start < floor or end <= start:
            raise ValueError(f"assistant turn {turn} begins before the previous one ends")
        spans.append((start, end))
        floor = end
    return spans


def _shared_header_end(head: str, prompt: str, floor: int, shared: int) -> int:
    """End of the turn header where the turn writes only the start of the generation prompt; -1 if it does not.

    DeepSeek's prompt is ``<｜Assistant｜><think>\n``, but an answer whose reasoning the template drops (content
    ``<think>...</think>answer``) or a tool call is written after ``<｜Assistant｜>`` alone. ``head`` (the chat so
    far plus the prompt) and the whole rendering part ``shared`` characters in: the header is then the prompt's
    longest part that the turn repeats and that ends a tag (``>``), so no tag is cut in two (a whole line of the
    prompt is found by :func:`_prompt_end` before this is tried); none of it
    where the turn repeats no such part (DeepSeek-V3 writes a second round of tool calls without a header)."""
    begin = len(head) - len(prompt)
    if not prompt or not head.endswith(prompt) or not floor <= begin <= shared:
        return -1
    return max(end for end in range(begin, shared + 1) if end == begin or head[end - 1] == ">")


def _beside_call_spans(processor: Any, conversation: list[dict], chat: ChatTemplate, tools: Any,
                       plain: str) -> list[tuple[int, int]]:
    """Spans of a chat whose assistant messages carry text beside their tool calls (module doc, method 5).

    Gemma 4 writes such a message's text after the tool responses that follow it, inside the same turn, so the turn
    is neither prefix-preserving nor framed by its header and terminator. The chat with that text emptied is
    located by the other methods; the full rendering must then be that text plus one insertion per emptied
    message, each holding the message's text and placed unambiguously (it cannot slide along equal characters).
    The insertions are the assistant's own tokens (its text and what the template writes with it), the other
    spans move with them. Raises a ValueError (empty where the chat has no such message)."""
    beside = [turn for turn, message in enumerate(conversation) if message["role"] == "assistant"
              and message.get("tool_calls") and _text_core(message)]
    if not beside:
        raise ValueError("")
    reduced = [{**message, "content": ""} if turn in beside else message for turn, message in enumerate(conversation)]
    [(text, spans)] = locate_turns(processor, [reduced], chat, [tools])
    opcodes = difflib.SequenceMatcher(None, text, plain, autojunk=False).get_opcodes()
    inserts = [(i1, plain[j1:j2]) for tag, i1, _, j1, j2 in opcodes if tag == "insert"]
    if (any(tag not in ("equal", "insert") for tag, *_ in opcodes) or len(inserts) != len(beside)
            or any(_text_core(conversation[turn]) not in piece for turn, (_, piece) in zip(beside, inserts))
            or any(at < len(text) and text[at] == piece[0] or at > 0 and text[at - 1] == piece[-1]
                   for at, piece in inserts)):
        raise ValueError("the text beside its tool calls is not written as one insertion of its own per message")

    def moved(at: int, inclusive: bool) -> int:
        return at + sum(len(piece) for where, piece in inserts if where < at or inclusive and where == at)

    placed = [(moved(a, True), moved(b, False)) for a, b in spans]
    placed += [(moved(at, False), moved(at, False) + len(piece)) for at, piece in inserts]
    return sorted(placed)


def _text_core(message: dict) -> str:
    """A message's text without its edge whitespace (its text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text") or "" for part in content if part.get("type") == "text")
    return content.strip() if isinstance(content, str) else ""


def _ends_with_special(processor: Any, terminator: str) -> bool:
    """Whether ``terminator`` (what a template writes after an assistant message) holds a special token."""
    tokenizer = getattr(processor, "tokenizer", processor)
    special = [token for token in getattr(tokenizer, "all_special_tokens", []) if len(token) > 1]
    special += [token for token in getattr(tokenizer, "get_added_vocab", dict)() if len(token) > 1]
    return bool(terminator.strip()) and any(token in terminator for token in special)


def _prompt_end(plain: str, prompt: str, floor: int, start: int) -> int:
    """End of the turn header in ``plain[floor:start]`` (its last occurrence); -1 if absent.

    The header is the generation prompt's shortest whole-line prefix followed by more than whitespace (else the
    whole prompt): a prompt that pre-fills text after the header (Qwen3.5's empty think block, written only on the
    final turn) leaves that text inside the span, where TRL's training variants put it too."""
    for cut in _header_cuts(prompt):
        head = plain.rfind(prompt[:cut], floor, start)
        if head >= 0:
            return head + cut
    return -1


def _header_cuts(prompt: str) -> list[int]:
    """Candidate ends of the turn header in the generation prompt, shortest first (:func:`_prompt_end`)."""
    return [i + 1 for i, char in enumerate(prompt) if char == "\n" and prompt[i + 1:].strip()] + [len(prompt)]


def _header_cut(prompt: str) -> int:
    return _header_cuts(prompt)[0]


def _unlocatable(chat: ChatTemplate, why: str, where: str | None = None) -> ValueError:
    place = f"{where}: " if where else ""
    return ValueError(
        f"{place}cannot locate the assistant turns of {chat.name} for label masking: {why}. Pass chat_template=... "
        "with each assistant turn (its text and end-of-turn token) wrapped in {% generation %}...{% endgeneration %}"
    )
