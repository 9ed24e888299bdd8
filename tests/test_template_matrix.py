"""Every official chat template TRL ships x edge chats: tokens are the template's own, labels match a reference
computed here WITHOUT vlm_pack code, and nothing is refused at batch time.

References (independent of vlm_pack's rendering): tokens = ``tokenizer.apply_chat_template(chat, tools=...,
tokenize=True)`` with the official template (TRL's copy in ``trl/chat_templates/``); labels = the assistant mask
of TRL's training variant of that template where it renders the same text (``return_assistant_tokens_mask``),
else each assistant turn read off prefix renderings: the text between ``render(chat[:i], add_generation_prompt=
True)`` and ``render(chat[:i + 1])`` when both are prefixes of the whole rendering; where the turn repeats only
the start of the generation prompt (DeepSeek), what ``render(chat[:i + 1])`` adds to ``render(chat[:i])`` less
that start, cut after a whole tag or line. Without an end-of-turn token
(GLM-4-MoE) TRL's training variant appends the next turn's opening tag to the final turn; the reference is then
that variant's own tokens and mask.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from vlm_pack.core.versions import has
from vlm_pack.models import get_family

IGNORE = -100
TEMPLATES_DIR = pathlib.Path(importlib.util.find_spec("trl").origin).parent / "chat_templates"
OFFICIAL = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja") if not p.stem.endswith("_training"))

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
_LONG = " ".join(f"Step {i}: the answer grows by one more clause, with numbers {i * 7} and words." for i in range(240))


def _call(arguments: dict | str) -> list[dict]:
    return [{"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": arguments}}]


# (name, messages, chat-level tools): single / multi-turn, system, edge whitespace, unicode, reasoning, tool calls,
# a long (~3k-token) answer.
EDGE_CHATS = [
    ("single", [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes."}], None),
    ("system_multi", [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again"},
                      {"role": "assistant", "content": "Bye"}], None),
    ("leading_newline", [{"role": "user", "content": "List one."}, {"role": "assistant", "content": "\n- one"}],
     None),
    ("trailing_spaces", [{"role": "user", "content": "Say ok "}, {"role": "assistant", "content": "ok.   "},
                         {"role": "user", "content": "Again"}, {"role": "assistant", "content": "ok  "}], None),
    ("whitespace_turn", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "},
                         {"role": "user", "content": "Answer now"}, {"role": "assistant", "content": "Now."}], None),
    ("unicode", [{"role": "user", "content": "Grüß dich, 日本語?"},
                 {"role": "assistant", "content": "Ünïcödé 你好 🙂 — ok"}], None),
    ("reasoning", [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "reasoning_content": "Two and two.\n", "content": "4"},
                   {"role": "user", "content": "3+3?"},
                   {"role": "assistant", "reasoning_content": "Three and three.", "content": "\n6"}], None),
    ("thinking", [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "thinking": "It is Paris.", "content": "Paris."}], None),
    ("tool_calls", [{"role": "system", "content": "You can call tools."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": _call({"city": "Paris"})},
                    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
                    {"role": "assistant", "content": "It is 21 degrees."}], TOOLS),
    ("tool_calls_none", [{"role": "user", "content": "Weather in Paris?"},  # OpenAI's content=None beside calls
                         {"role": "assistant", "content": None, "tool_calls": _call({"city": "Paris"})},
                         {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
                         {"role": "assistant", "content": "21 degrees."}], TOOLS),
    ("long", [{"role": "user", "content": "Explain at length."}, {"role": "assistant", "content": _LONG}], None),
    # reasoning written into the content (DeepSeek-R1's format; its template keeps only what follows </think>)
    ("think_in_content", [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
                          {"role": "user", "content": "3+3?"},
                          {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"}], None),
    ("reasoning_only", [{"role": "user", "content": "Think first."},  # an answer that is reasoning alone
                        {"role": "assistant", "reasoning_content": "Nothing to add yet.", "content": ""},
                        {"role": "user", "content": "Now answer."}, {"role": "assistant", "content": "Done."}], None),
    # arguments as a JSON string (DeepSeek's templates concatenate them), two rounds
    ("tool_calls_json", [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": _call('{"city": "Paris"}')},
                         {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
                         {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "Rome?"},
                         {"role": "assistant", "content": "", "tool_calls": _call('{"city": "Rome"}')},
                         {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "25 C"},
                         {"role": "assistant", "content": "25 degrees."}], TOOLS),
]


def template(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _render(tokenizer, chat, chat_template, tools, **kwargs) -> str:
    return tokenizer.apply_chat_template(chat, chat_template=chat_template, tools=tools, tokenize=False, **kwargs)


def reference(tokenizer, name: str, chat: list[dict], tools) -> tuple[list[int], list[int]] | None:
    """(tokens, labels) of ``chat`` under the official template ``name``; None when the template refuses the chat
    or no reference locates its turns."""
    official = template(name)
    # transformers drops content=None keys (OpenAI's tool-call turns) from 5.24 on; the reference does it on any release
    chat = [{key: value for key, value in message.items() if not (key == "content" and value is None)}
            for message in chat]
    try:
        text = _render(tokenizer, chat, official, tools)
    except Exception:
        return "template refuses"  # the template itself refuses this chat (e.g. no system role): nothing to compare
    ids = tokenizer.apply_chat_template(chat, chat_template=official, tools=tools, tokenize=True,
                                        return_dict=True)["input_ids"]
    training = TEMPLATES_DIR / f"{name}_training.jinja"
    if training.is_file():
        variant = training.read_text(encoding="utf-8")
        if _render(tokenizer, chat, variant, tools) in (text, text + "<|user|>" if name == "glm4moe" else text):
            marked = tokenizer.apply_chat_template(chat, chat_template=variant, tools=tools, tokenize=True,
                                                   return_dict=True, return_assistant_tokens_mask=True)
            return marked["input_ids"], [t if m else IGNORE for t, m in zip(marked["input_ids"],
                                                                            marked["assistant_masks"])]
    spans = _prefix_reference(tokenizer, official, chat, tools, text)
    if spans is None:
        spans = _markup_reference(text, sum(m["role"] == "assistant" for m in chat))
    if spans is None:
        spans = _segment_reference(tokenizer, official, chat, tools, text)
    if spans is None:
        return "no reference"
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == ids
    labels = [t if any(s < b and a < e for s, e in spans) else IGNORE
              for t, (a, b) in zip(ids, encoded["offset_mapping"])]
    return ids, labels


def _prefix_reference(tokenizer, official, chat, tools, text) -> list[tuple[int, int]] | None:
    """Each assistant turn = what ``render(chat[:i + 1])`` adds to ``render(chat[:i], add_generation_prompt=True)``,
    when both are prefixes of the whole rendering (a prefix-preserving template)."""
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, chat[:i], official, tools, add_generation_prompt=True)
        upto = _render(tokenizer, chat[:i + 1], official, tools)
        if not (text.startswith(upto) and upto.startswith(head)):
            return None
        spans.append((len(head), len(upto)))
    return spans


def _segment_reference(tokenizer, official, chat, tools, text) -> list[tuple[int, int]] | None:
    """Each assistant turn = what ``render(chat[:i + 1])`` adds to ``render(chat[:i])`` (both prefixes of the whole
    rendering), less the longest part of the generation prompt it starts with that ends a tag or a line (DeepSeek's
    prompt is ``<｜Assistant｜><think>\n``; a turn whose reasoning the template drops, or a tool call, starts with
    ``<｜Assistant｜>`` alone)."""
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, chat[:i], official, tools)
        prompt = _render(tokenizer, chat[:i], official, tools, add_generation_prompt=True)[len(before):]
        upto = _render(tokenizer, chat[:i + 1], official, tools)
        if not (text.startswith(upto) and upto.startswith(before)):
            return None
        turn = upto[len(before):]
        header = max(c for c in range(len(prompt) + 1) if (c == 0 or prompt[c - 1] in ">\n")
                     and turn.startswith(prompt[:c]))
        spans.append((len(before) + header, len(upto)))
    return spans


# Turn markup of the templates that render an assistant turn differently once later messages follow (Qwen3 and
# its successors write reasoning on the turns after the last user message only; Gemma 4 and LFM2.5 likewise):
# (assistant header, end of turn).
_MARKUP = (("<|im_start|>assistant\n", "<|im_end|>\n"), ("<|turn>model\n", "<turn|>\n"))


def _markup_reference(text: str, turns: int) -> list[tuple[int, int]] | None:
    """Each assistant turn read off the rendered text's own markup: from the end of the k-th assistant header to
    the end of the first end-of-turn marker after it."""
    for header, end in _MARKUP:
        starts = [i + len(header) for i in range(len(text)) if text.startswith(header, i)]
        if len(starts) == turns and turns:
            return [(a, text.index(end, a) + len(end)) for a in starts]
    return None


def _example(chat, tools) -> dict:
    return {"messages": chat, **({"tools": tools} if tools else {})}


def vlm_pack_outcomes(tokenizer, name: str) -> dict[tuple[str, str], str]:
    """{(chat, path): exact | wrong | refused ... | template refuses} for the official template ``name`` through
    ``prepare``'s encoder and the collator (a plain tokenizer), all chats of a path in one batch (one by one only
    to say which one a refusal concerns)."""
    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.offline.encoding import SampleEncoder, SampleFormat

    official = template(name)
    try:
        encoder = SampleEncoder(tokenizer, SampleFormat(template="chat"), None, chat_template=official)
        collator = VLMPackingCollator(tokenizer, max_length=1 << 16, chat_template=official)
    except ValueError as exc:
        return {(chat, path): f"refused at construction: {exc}" for chat, _, _ in EDGE_CHATS
                for path in ("prepare", "collator")}
    expected = {chat_name: reference(tokenizer, name, chat, tools) for chat_name, chat, tools in EDGE_CHATS}
    outcomes = {(chat_name, path): want for chat_name, want in expected.items() if isinstance(want, str)
                for path in ("prepare", "collator")}
    cases = [(chat_name, chat, tools) for chat_name, chat, tools in EDGE_CHATS
             if not isinstance(expected[chat_name], str)]

    def prepare(chats):
        ids, masks = encoder.encode([_example(chat, tools) for _, chat, tools in chats], [n for n, _, _ in chats])
        return [(list(i), [t if m else IGNORE for t, m in zip(i, mask)]) for i, mask in zip(ids, masks)]

    def collate(chats):
        batch = collator([_example(chat, tools) for _, chat, tools in chats])
        cu = batch["vlm_pack"]["cu_seqlens"].tolist()
        return [(batch["input_ids"][0, a:b].tolist(), batch["labels"][0, a:b].tolist()) for a, b in zip(cu, cu[1:])]

    for path, run in (("prepare", prepare), ("collator", collate)) if cases else ():
        try:
            results = run(cases)
        except ValueError:
            results = []
            for case in cases:
                try:
                    results += run([case])
                except ValueError as exc:
                    results.append(f"refused: {exc}")
        for (chat_name, _, _), got in zip(cases, results):
            if isinstance(got, str):
                outcomes[chat_name, path] = got
                continue
            want_ids, want_labels = expected[chat_name]
            want_labels = [IGNORE] + want_labels[1:] if path == "collator" else want_labels  # first label -100
            outcomes[chat_name, path] = "exact" if got == (list(want_ids), want_labels) else "wrong"
    return outcomes


def _summary(tokenizer, names=OFFICIAL) -> dict[str, dict]:
    return {name: vlm_pack_outcomes(tokenizer, name) for name in names}


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from vlm_pack.assets import qwen_tokenizer_path

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()))


def _counts(summary) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcomes in summary.values():
        for outcome in outcomes.values():
            kind = outcome.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def test_every_official_template_on_every_edge_chat_is_exact(real_tokenizer):
    """41 official templates x 14 edge chats x (prepare's encoder, the collator): every chat the template renders
    is exact (tokens and labels), none refused, none wrong. Measured before this rule (75003fa, this harness, 11
    chats): 561 exact, 122 wrong, 137 refused at batch time (82 chats the templates themselves reject either way);
    at 3ec0e60 the 3 chats added since (reasoning in the content, a reasoning-only answer, JSON-string tool
    arguments) gave 4 refusals at batch time (DeepSeek-R1-Distill's reasoning in the content, DeepSeek-V3's tool
    calls), which the construction-time probes now catch and the shared-header rule labels."""
    assert len(OFFICIAL) == 41 and len(EDGE_CHATS) == 14
    summary = _summary(real_tokenizer)
    bad = {(name, chat, path): outcome for name, outcomes in summary.items()
           for (chat, path), outcome in outcomes.items() if outcome not in ("exact", "template refuses")}
    assert not bad, bad
    assert _counts(summary) == {"exact": 1006, "template refuses": 142}


def test_a_chat_the_template_refuses_is_named(real_tokenizer):
    """Where the template itself refuses a chat (Gemma's has no system role), vlm_pack says which sample and why."""
    from vlm_pack.offline.encoding import SampleEncoder, SampleFormat

    encoder = SampleEncoder(real_tokenizer, SampleFormat(template="chat"), None, chat_template=template("gemma"))
    chat = dict((n, c) for n, c, _ in EDGE_CHATS)["system_multi"]
    with pytest.raises(ValueError, match=r"^row 7: the chat template cannot render it \(TemplateError"):
        encoder.encode([_example(chat, None)], ["row 7"])


# Planted bugs the matrix must catch: (what, target, replacement factory).
def _drop_fields(turns, text_only):
    return [{"role": m["role"], **({"content": m["content"]} if "content" in m else {})}
            for m in _original_template_messages(turns, text_only)]


_original_template_messages = None


@pytest.mark.parametrize("bug", ["fields dropped", "header taken as the whole prompt", "terminator left out",
                                 "markup spans", "stop tag ignored", "partial header not accepted",
                                 "partial header cut mid-tag"])
def test_planted_bugs_are_caught(real_tokenizer, monkeypatch, bug):
    """Each planted bug makes some case of the matrix wrong or refused (on the templates it concerns)."""
    global _original_template_messages
    import vlm_pack.data.chat as chat_module
    import vlm_pack.data.chat_template as ct

    names = {"fields dropped": ["qwen3", "gptoss"], "header taken as the whole prompt": ["qwen3_5_think"],
             "terminator left out": ["gemma4", "qwen3"], "markup spans": ["qwen3"], "stop tag ignored": ["glm4moe"],
             "partial header not accepted": ["deepseekv3", "deepseek_r1_distill"],
             "partial header cut mid-tag": ["deepseekv3", "deepseek_r1_distill"]}[bug]
    if bug == "fields dropped":  # messages stripped to role/content, as before this rule
        _original_template_messages = chat_module.template_messages
        monkeypatch.setattr(chat_module, "template_messages", _drop_fields)
        original_conversation = __import__("vlm_pack.offline.encoding", fromlist=["x"]).SampleEncoder._conversation
        monkeypatch.setattr("vlm_pack.offline.encoding.SampleEncoder._conversation", lambda self, row: [
            {"role": m["role"], "content": m.get("content") or ""} for m in original_conversation(self, row)])
    elif bug == "header taken as the whole prompt":  # Qwen3.5's pre-filled think block left out of the span
        monkeypatch.setattr(ct, "_header_cuts", lambda prompt: [len(prompt)])
    elif bug == "terminator left out":
        original_spans = ct._prefix_spans
        monkeypatch.setattr(ct, "_prefix_spans", lambda *a: [(s, e - 1) for s, e in original_spans(*a)])
        original_sentinels = ct._sentinel_spans
        monkeypatch.setattr(ct, "_sentinel_spans", lambda *a: [(s, e - 1) for s, e in original_sentinels(*a)])
        original_markup = ct._markup_spans
        monkeypatch.setattr(ct, "_markup_spans", lambda *a: [(s, e - 1) for s, e in original_markup(*a) or []] or None)
    elif bug == "partial header not accepted":  # DeepSeek's tool calls / dropped reasoning: refused when built
        monkeypatch.setattr(ct, "_shared_header_end", lambda *a: -1)
    elif bug == "partial header cut mid-tag":  # the longest shared part of the prompt, not the longest whole tag
        monkeypatch.setattr(ct, "_shared_header_end", lambda head, prompt, floor, shared: shared)
    elif bug == "markup spans":  # turns read off the markup one character late
        original_markup = ct._markup_spans
        monkeypatch.setattr(ct, "_markup_spans", lambda *a: [(s + 1, e) for s, e in original_markup(*a) or []] or None)
    else:  # GLM-4-MoE's final stop tag not appended: the variant's text must equal the template's
        original_render = ct.render_texts

        def render(*args, **kwargs):
            texts, spans = original_render(*args, **kwargs)
            if kwargs.get("marks"):
                spans = [[(a, min(b, len(t) - len("<|user|>")) if t.endswith("<|user|>") else b) for a, b in found]
                         for t, found in zip(texts, spans)]
                texts = [t.removesuffix("<|user|>") for t in texts]
            return texts, spans

        monkeypatch.setattr(ct, "render_texts", render)
    counts = _counts(_summary(real_tokenizer, names))
    assert counts.get("wrong", 0) + sum(v for k, v in counts.items() if k.startswith("refused")) > 0, counts


if __name__ == "__main__":
    import collections
    import sys

    from transformers import AutoTokenizer

    from vlm_pack.assets import qwen_tokenizer_path

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()))
    counts = collections.Counter()
    for name, outcomes in _summary(tok).items():
        for (chat, path), outcome in outcomes.items():
            kind = outcome.split(":")[0]
            counts[kind] += 1
            if kind not in ("exact",) or "-v" in sys.argv:
                print(f"{name:24s} {chat:16s} {path:8s} {outcome[:300]}")
    print(dict(counts))


# ------------------------------------------------------------------ the VLM templates, through the processor path


def _vlm_processor(name: str):
    """(processor, model config, chat_template to pass or None) of a VLM template with a tiny offline processor."""
    from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor
    from vlm_pack.testing.tiny_models import offline_gemma3_processor, offline_qwen2vl_processor, tiny_config

    if name in ("qwen2_5_vl", "qwen3_vl", "qwen3_5_think", "qwen3_5_nothink"):
        family = {"qwen3_5_think": "qwen3_5", "qwen3_5_nothink": "qwen3_5"}.get(name, name)
        return offline_qwen2vl_processor(), tiny_config(family), template(name)
    if name == "gemma3":
        return offline_gemma3_processor(), tiny_config("gemma3"), template(name)
    if name == "gemma4":
        from test_budget_packs import _gemma4_processor

        processor = _gemma4_processor()
        return processor, tiny_config("gemma4"), processor.chat_template
    processor = tiny_vlm_processor(name)
    return processor, tiny_vlm(name, processor, layers=1).config, template(name)


VLM_TEMPLATES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_think", "qwen3_5_nothink", "gemma3", "gemma4", "idefics3",
                 "smolvlm", "llava_next")
_WITH_IMAGE = ("single", "system_multi", "unicode", "reasoning")


def _vlm_chat(chat_name: str, chat: list[dict]) -> list[dict]:
    """The edge chat with list content (what VLM templates index), an image first in its first user turn."""
    from PIL import Image

    out, image = [], chat_name in _WITH_IMAGE
    for message in chat:
        parts = [{"type": "text", "text": message["content"]}] if message.get("content") is not None else None
        if image and message["role"] == "user":
            parts = [{"type": "image", "image": Image.new("RGB", (40, 32), (200, 30, 90))}, *parts]
            image = False
        out.append({**{k: v for k, v in message.items() if k != "content"}, **({"content": parts} if parts else {})})
    return out


_PIECES = ("{%- for piece in messages[0]['pieces'] -%}{%- if piece[1] -%}{% generation %}{{ piece[0] }}"
           "{% endgeneration %}{%- else -%}{{ piece[0] }}{%- endif -%}{%- endfor -%}")
_VISION = {"processor_kwargs": {"images_kwargs": {"return_tensors": "pt"},
                                "text_kwargs": {"return_tensors": None, "padding": False}},
           # transformers < 5.23 forwards return_tensors flat (a clash) and forwards nothing when it is left out
           **({"return_tensors": "auto"} if has("chat_template_auto_tensors") else {})}


def vlm_reference(processor, official: str, name: str, chat: list[dict], tools):
    """(tokens, labels) through the processor (images expanded): tokens of ``apply_chat_template`` with the
    official template; labels from TRL's training variant where it renders the same text, else from the text
    spans of the prefix / markup references written as generation blocks, masked by the processor itself."""
    try:
        text = processor.apply_chat_template(chat, chat_template=official, tools=tools, tokenize=False)
    except Exception:
        return "template refuses"

    def tokens(template_, conversation, **kw):
        out = processor.apply_chat_template(conversation, chat_template=template_, tools=tools, tokenize=True,
                                            return_dict=True, **_VISION, **kw)
        return np.asarray(out["input_ids"]).reshape(-1).tolist(), out

    ids, _ = tokens(official, chat)
    training = TEMPLATES_DIR / f"{name}_training.jinja"
    variant = training.read_text(encoding="utf-8") if training.is_file() else None
    if variant is not None and processor.apply_chat_template(chat, chat_template=variant, tools=tools,
                                                             tokenize=False) == text:
        marked, out = tokens(variant, chat, return_assistant_tokens_mask=True)
    else:
        spans = _prefix_reference(processor, official, chat, tools, text) or _markup_reference(
            text, sum(m["role"] == "assistant" for m in chat))
        if spans is None:
            return "no reference"
        pieces, start = [], 0
        for a, b in spans:
            pieces += [(text[start:a], False), (text[a:b], True)]
            start = b
        pieces.append((text[start:], False))
        marked, out = tokens(_PIECES, [{**chat[0], "pieces": pieces}, *chat[1:]], return_assistant_tokens_mask=True)
    assert marked == ids
    mask = np.asarray(out["assistant_masks"]).reshape(-1)
    return ids, [t if m else IGNORE for t, m in zip(ids, mask)]


def test_vlm_templates_through_the_processor_are_exact():
    """The VLM templates whose tiny processors vlm_pack.testing builds, x the edge chats (4 with an image):
    collator tokens == the processor's apply_chat_template, labels == the reference; none refused or wrong
    (116 exact; with the 11 chats of 75003fa, then: 72 exact, 5 wrong, 16 refused at batch time)."""
    from vlm_pack.data.collator import VLMPackingCollator

    counts: dict[str, int] = {}
    bad = []
    # Before transformers 5.23 the processor's own mask (the reference's labels) is not shifted for expanded images:
    # there, chats with an image compare tokens only (their labels: tests/test_template_fidelity.py, an independent
    # answer span), and families whose expansion writes text are refused by the collator.
    shifted = has("processor_mask_shift")
    for name in VLM_TEMPLATES:
        processor, config, official = _vlm_processor(name)
        if not shifted and get_family(config).encoding.expansion_writes_text:
            with pytest.raises(ValueError, match=r"transformers>=5\.23"):
                VLMPackingCollator(processor, max_length=1 << 16, model_config=config, chat_template=official)
            continue
        collator = VLMPackingCollator(processor, max_length=1 << 16, model_config=config, chat_template=official)
        cases, expected = [], []
        for chat_name, chat, tools in EDGE_CHATS:
            chat = _vlm_chat(chat_name, chat)
            want = vlm_reference(processor, official, name, chat, tools)
            if isinstance(want, str):
                counts[want] = counts.get(want, 0) + 1
                continue
            cases.append((chat_name, chat, tools))
            expected.append(want)
        batch = collator([_example(chat, tools) for _, chat, tools in cases])
        cu = batch["vlm_pack"]["cu_seqlens"].tolist()
        for (chat_name, _, _), (ids, labels), a, b in zip(cases, expected, cu, cu[1:]):
            got = (batch["input_ids"][0, a:b].tolist(), batch["labels"][0, a:b].tolist())
            ok = got == (ids, [IGNORE] + labels[1:]) or (not shifted and chat_name in _WITH_IMAGE and got[0] == ids)
            counts["exact" if ok else "wrong"] = counts.get("exact" if ok else "wrong", 0) + 1
            if not ok:
                bad.append((name, chat_name))
    assert not bad, bad
    assert counts == {"exact": 116, "template refuses": 10} or not shifted, counts


def test_template_kwargs_reach_every_rendering_and_unknown_ones_are_refused(real_tokenizer):
    """``template_kwargs={"enable_thinking": False}`` with Qwen3.5 (its generation prompt pre-fills an empty think
    block then): tokens == apply_chat_template(..., enable_thinking=False), labels == TRL's variant rendered with it;
    a variable the template never reads, or one the renderer sets, is refused when built."""
    from vlm_pack.data.collator import VLMPackingCollator

    chat = next(c for n, c, _ in EDGE_CHATS if n == "single")
    official, variant = template("qwen3_5_think"), template("qwen3_5_think_training")
    collator = VLMPackingCollator(real_tokenizer, max_length=4096, chat_template=official,
                                  template_kwargs={"enable_thinking": False})
    batch = collator([{"messages": chat}])
    want = real_tokenizer.apply_chat_template(chat, chat_template=variant, enable_thinking=False, tokenize=True,
                                              return_dict=True, return_assistant_tokens_mask=True)
    assert want["input_ids"] == real_tokenizer.apply_chat_template(chat, chat_template=official, enable_thinking=False,
                                                                   tokenize=True, return_dict=True)["input_ids"]
    assert batch["input_ids"][0].tolist() == want["input_ids"]
    assert batch["labels"][0].tolist()[1:] == [t if m else IGNORE for t, m in zip(want["input_ids"],
                                                                                 want["assistant_masks"])][1:]
    with pytest.raises(ValueError, match="never reads 'enable_reasoning'"):
        VLMPackingCollator(real_tokenizer, max_length=64, chat_template=official,
                           template_kwargs={"enable_reasoning": False})
    with pytest.raises(ValueError, match="'tools' is set by the renderer itself; give tools per example"):
        VLMPackingCollator(real_tokenizer, max_length=64, chat_template=official, template_kwargs={"tools": []})


TEXT_BESIDE_CALL = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "Let me check.", "tool_calls": _call({"city": "Paris"})},
                    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
                    {"role": "assistant", "content": "21 degrees."}]


def _labelled_runs(tokenizer, batch) -> list[str]:
    labels = batch["labels"][0]
    keep = (labels != IGNORE).nonzero().flatten().tolist()
    runs, run = [], [keep[0]]
    for a, b in zip(keep, keep[1:]):
        if b != a + 1:
            runs.append(run)
            run = []
        run.append(b)
    return [tokenizer.decode(batch["input_ids"][0, r].tolist()) for r in runs + [run]]


def test_text_beside_tool_calls_in_gemma4_is_labelled_where_the_template_moves_it(real_tokenizer, monkeypatch):
    """Gemma 4 writes an assistant message's text that sits beside its tool calls AFTER the tool responses, inside
    the same turn (refused at batch time before). Tokens == apply_chat_template; labelled: the call with the
    response opener (as for a call without text), then the moved text and the final answer with their end of turn,
    the tool response not (written by hand from the rendering). Planted: the moved text left unlabelled."""
    import vlm_pack.data.chat_template as ct
    from vlm_pack.data.collator import VLMPackingCollator

    collator = VLMPackingCollator(real_tokenizer, max_length=4096, chat_template=template("gemma4"))
    example = _example(TEXT_BESIDE_CALL, TOOLS)
    batch = collator([example])
    assert batch["input_ids"][0].tolist() == real_tokenizer.apply_chat_template(
        TEXT_BESIDE_CALL, tools=TOOLS, chat_template=template("gemma4"), tokenize=True, return_dict=True)["input_ids"]
    assert _labelled_runs(real_tokenizer, batch) == [
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
        "Let me check.<turn|>\n21 degrees.<turn|>\n"]
    original = ct._beside_call_spans
    monkeypatch.setattr(ct, "_beside_call_spans", lambda *a: original(*a)[:1] + original(*a)[2:])
    assert _labelled_runs(real_tokenizer, collator([example])) != _labelled_runs(real_tokenizer, batch)
