"""The model's own chat template, and where its assistant turns are (no torch: the offline path keys caches on it).

Tokens are always those of the model's OWN template (or the caller's ``chat_template=``): exactly what
``processor.apply_chat_template(..., tokenize=True)`` gives, so fine-tuning sees the format used at inference.
Labels need the assistant spans; they come from, in order:

1. the template's own ``{% generation %}`` blocks (Hugging Face's ``return_assistant_tokens_mask``);
2. TRL's training variant of that exact template (``trl.chat_template_utils.get_training_chat_template``), used
   for a batch only when it renders every sample to the same text as the template itself;
3. per-message sentinels: each assistant message is rendered with unique markers around its text; the markers,
   once removed, must leave exactly the plain rendering (so they changed nothing), and each span runs from the
   end of the template's own generation prompt (what ``add_generation_prompt`` writes) to the end of the turn's
   terminator (what the template writes after an assistant message). The spans are handed to Hugging Face's
   mask machinery through a template that writes the plain rendering piece by piece.

Anything else fails closed with a ``ValueError`` naming the template, the sample and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ACCEPTED_ROLES",
    "RENDERING_RULE",
    "CHATML_TEMPLATE",
    "ChatTemplate",
    "check_role",
    "render_with_assistant_masks",
    "resolve_chat_template",
]

# Names how tokens and spans are chosen (module doc); part of the offline token-cache key, so caches written under
# another rule (e.g. the former ChatML fallback) are never reused. Change it whenever the rule changes.
RENDERING_RULE = "own template; spans from generation blocks, TRL's training variant, or sentinels (v1)"
# Roles a conversation may use; anything else (e.g. "Assistant") is a typo that would silently drop labels.
ACCEPTED_ROLES = ("system", "user", "assistant", "tool")

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
    training variant of it); None when spans come from sentinels. ``name``: how errors name the template.
    ``prompt`` / ``terminator``: what the template writes before an assistant message's text
    (``add_generation_prompt``) and after it, for the sentinel method; ``unlocatable``: why the sentinel method
    cannot work with this template (then only ``marked`` can give spans).
    """

    template: str
    marked: str | None
    name: str
    prompt: str = ""
    terminator: str = ""
    unlocatable: str | None = None


def check_role(role: Any, where: str) -> None:
    """Refuse a role outside :data:`ACCEPTED_ROLES` (a misspelled one would silently lose its labels)."""
    if role not in ACCEPTED_ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; accepted roles: {', '.join(ACCEPTED_ROLES)}")


def resolve_chat_template(processor: Any, chat_template: str | None = None) -> ChatTemplate:
    """The caller's template, else the processor's own; with the way its assistant spans are found (module doc)."""
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
    if _GENERATION_TAG.search(template):
        return ChatTemplate(template, template, name)
    chat = ChatTemplate(template, _trl_training_variant(processor, template), name)
    try:
        prompt, terminator = _turn_markup(processor, chat)
    except ValueError as exc:
        if chat.marked is None:
            raise
        return replace(chat, unlocatable=str(exc))
    return replace(chat, prompt=prompt, terminator=terminator)


def _trl_training_variant(processor: Any, template: str) -> str | None:
    """TRL's training variant of ``template`` (an exact copy of an official template plus generation blocks)."""
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        return None
    try:
        original = processor.chat_template
        processor.chat_template = template
        try:
            variant = get_training_chat_template(processor)
        finally:
            processor.chat_template = original
    except Exception:  # TRL refuses templates it does not know (ValueError) or cannot probe: sentinels then
        return None
    return variant if isinstance(variant, str) and _GENERATION_TAG.search(variant) else None


def render_with_assistant_masks(
    processor: Any, conversations: list[list[dict]], chat: ChatTemplate, **kwargs: Any
) -> Mapping[str, Any]:
    """``processor.apply_chat_template(conversations, tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True, **kwargs)``, with tokens of ``chat.template`` and masks on assistant spans."""
    def call(template: str, convs: list[list[dict]]) -> Mapping[str, Any]:
        return processor.apply_chat_template(
            convs, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            **kwargs,
        )

    if chat.marked == chat.template:
        return call(chat.template, conversations)
    plain = _texts(processor, conversations, chat.template)
    if chat.marked is not None and _texts(processor, conversations, chat.marked) == plain:
        return call(chat.marked, conversations)
    if chat.unlocatable is not None:
        raise ValueError(f"TRL's training variant of {chat.name} renders this batch differently from the template "
                         f"itself, and {chat.unlocatable}")
    marked = _texts(processor, [_with_sentinels(conversation) for conversation in conversations], chat.template)
    spans = [_sentinel_spans(conversation, text, with_marks, chat, index)
             for index, (conversation, text, with_marks) in enumerate(zip(conversations, plain, marked))]
    if not kwargs.keys() - {"tokenizer_kwargs"} and not hasattr(processor, "image_processor"):
        return _tokenize_spans(processor, plain, spans, kwargs.get("tokenizer_kwargs") or {})
    pieced = []
    for conversation, text, text_spans in zip(conversations, plain, spans):
        pieces, start = [], 0
        for begin, end in text_spans:
            pieces += [(text[start:begin], False), (text[begin:end], True)]
            start = end
        pieces.append((text[start:], False))
        pieced.append([{**conversation[0], _PIECES_KEY: pieces}, *conversation[1:]])
    return call(_PIECES_TEMPLATE, pieced)


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
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        bounds = np.asarray(text_spans, dtype=np.int64).reshape(-1, 2)
        # the first span ending after the token starts; the token overlaps it when it ends after that span starts
        span = np.searchsorted(bounds[:, 1], offsets[:, 0], side="right")
        inside = span < len(bounds)
        mask = np.zeros(len(offsets), dtype=np.uint8)
        mask[inside] = offsets[inside, 1] > bounds[span[inside], 0]
        masks.append(mask)
    return {"input_ids": out["input_ids"], "assistant_masks": masks}


def _texts(processor: Any, conversations: list[list[dict]], template: str) -> list[str]:
    texts = processor.apply_chat_template(conversations, chat_template=template, tokenize=False)
    return [texts] if isinstance(texts, str) else list(texts)


def _render_one(processor: Any, conversation: list[dict], template: str, **kwargs: Any) -> str:
    text = processor.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    return text if isinstance(text, str) else text[0]


def _turn_markup(processor: Any, chat: ChatTemplate) -> tuple[str, str]:
    """(generation prompt, assistant-turn terminator) of ``chat.template``, read off a two-turn probe."""
    user = [{"role": "user", "content": _probe_content(processor, "Hi")}]
    try:
        bare = _render_one(processor, user, chat.template)
        prompt = _render_one(processor, user, chat.template, add_generation_prompt=True)
        answered = _render_one(
            processor, user + [{"role": "assistant", "content": _probe_content(processor, f"Yes{_mark(0, 'e')}")}],
            chat.template,
        )
    except Exception as exc:
        raise _unlocatable(chat, f"it cannot render a probe conversation ({type(exc).__name__}: {exc})") from exc
    if not prompt.startswith(bare) or len(prompt) == len(bare):
        raise _unlocatable(chat, "add_generation_prompt=True adds no assistant prompt after the conversation")
    if answered.count(_mark(0, "e")) != 1:
        raise _unlocatable(chat, "it does not write an assistant message's text as given")
    return prompt[len(bare):], answered.split(_mark(0, "e"))[1]


def _probe_content(processor: Any, text: str) -> Any:
    return [{"type": "text", "text": text}] if hasattr(processor, "image_processor") else text


def _mark(turn: int, side: str) -> str:
    return f"{_OPEN}{turn}{side}{_CLOSE}"


def _with_sentinels(conversation: list[dict]) -> list[dict]:
    """Each assistant message's text wrapped in its own start/end sentinels (first and last text part)."""
    marked = []
    for turn, message in enumerate(conversation):
        content = message["content"]
        if message["role"] == "assistant":
            if isinstance(content, str):
                content = _mark(turn, "s") + content + _mark(turn, "e")
            else:
                texts = [i for i, part in enumerate(content) if part.get("type") == "text"]
                content = [dict(part) for part in content]
                if texts:
                    content[texts[0]]["text"] = _mark(turn, "s") + content[texts[0]]["text"]
                    content[texts[-1]]["text"] += _mark(turn, "e")
        marked.append({**message, "content": content})
    return marked


def _sentinel_spans(
    conversation: list[dict], plain: str, marked: str, chat: ChatTemplate, index: int
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``plain`` given its rendering with sentinels ``marked`` (module
    doc, method 3); fails closed."""
    where = f"sample {index}"
    turns = [turn for turn, message in enumerate(conversation) if message["role"] == "assistant"]
    found, pieces, last = [], [], 0
    for match in _SENTINEL.finditer(marked):
        pieces.append(marked[last:match.start()])
        last = match.end()
        found.append((int(match.group(1)), match.group(2), sum(map(len, pieces))))
    pieces.append(marked[last:])
    if "".join(pieces) != plain:
        raise _unlocatable(chat, "marking an assistant message changes how the template renders it", where)
    expected = [(turn, side) for turn in turns for side in "se"]
    if [(turn, side) for turn, side, _ in found] != expected:
        raise _unlocatable(chat, "it drops, repeats or reorders an assistant message's text", where)
    spans, floor = [], 0
    for (_, _, start), (_, _, end) in zip(found[::2], found[1::2]):
        head = _prompt_end(plain, chat.prompt, floor, start)
        if head < 0 or not plain.startswith(chat.terminator, end):
            raise _unlocatable(chat, "an assistant message is not framed by the template's own prompt and "
                               "terminator", where)
        spans.append((head, end + len(chat.terminator)))
        floor = spans[-1][1]
    return spans


def _prompt_end(plain: str, prompt: str, floor: int, start: int) -> int:
    """End of the turn header in ``plain[floor:start]`` (its last occurrence); -1 if absent.

    The header is the generation prompt's shortest whole-line prefix followed by more than whitespace (else the
    whole prompt): a prompt that pre-fills text after the header (Qwen3.5's empty think block, written only on the
    final turn) leaves that text inside the span, where TRL's training variants put it too."""
    cuts = [i + 1 for i, char in enumerate(prompt) if char == "\n" and prompt[i + 1:].strip()] + [len(prompt)]
    for cut in cuts:
        head = plain.rfind(prompt[:cut], floor, start)
        if head >= 0:
            return head + cut
    return -1


def _unlocatable(chat: ChatTemplate, why: str, where: str | None = None) -> ValueError:
    place = f"{where}: " if where else ""
    return ValueError(
        f"{place}cannot locate the assistant turns of {chat.name} for label masking: {why}. Pass chat_template=... "
        "with each assistant turn (its text and end-of-turn token) wrapped in {% generation %}...{% endgeneration %}"
    )
