"""`prepare` chat labels come from the rendering (generation spans), never from searching the reply's text.

The expected tokens and labels are built independently: each piece of the shipped Qwen tokenizer's OWN template
(Qwen3's ChatML: the final answer opens with an empty think block) tokenised on its own and concatenated, labels
where TRL's training variant of the Qwen3 template puts them: everything after "<|im_start|>assistant\n" up to
and including "<|im_end|>\n".
"""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from vlm_pack.offline.prepare import prepare_packed_sequence_data
from vlm_pack.offline.storage import open_packed
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

CONVERSATIONS = [
    # the reply also occurs, earlier, in the user's question
    [{"role": "user", "content": "Yes or no: is the sky blue?"}, {"role": "assistant", "content": "Yes"}],
    # the reply is the start of a word of the prompt (off a token boundary)
    [{"role": "user", "content": "Yesterday or today?"}, {"role": "assistant", "content": "Yes"}],
    # the same reply twice: both turns are labelled
    [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hello"}],
    # a reply that repeats a previous turn's reply inside a longer one
    [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "Say ok twice."}, {"role": "assistant", "content": "ok ok"}],
    # the reply inside the system prompt
    [{"role": "system", "content": "Answer with Yes or No only."},
     {"role": "user", "content": "Is water wet?"}, {"role": "assistant", "content": "Yes"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_path())


def _expected(tokenizer, messages):
    """ChatML pieces tokenised one by one: (ids, labels mask)."""
    ids, mask = [], []

    def add(text, label):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([label] * len(piece))

    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages):
        answer = int(m["role"] == "assistant")
        add(f"<|im_start|>{m['role']}\n", 0)
        if answer and i > last_user:
            add("<think>\n\n</think>\n\n", 1)
        add(m["content"], answer)
        add("<|im_end|>", answer)
        add("\n", answer)
    return ids, mask


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("chat")
    rows = [{"messages": c} for c in CONVERSATIONS] + [{"prompt": "Name a colour.", "response": "Blue."}]
    path = root / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # no --template: the messages column is detected
    written = prepare_packed_sequence_data(path, tokenizer, root, [512], tokenizer_name="t", progress=False,
                                           cache_dir=str(root / "cache"), log=lambda _: None)
    return rows, open_packed(written[0].path), written[0].metadata


def test_labels_cover_exactly_each_assistant_reply(prepared, tokenizer):
    rows, data, meta = prepared
    assert meta["template"] == "chat" and data.num_samples == len(rows)
    for s in range(data.num_samples):
        lo, hi = data.seq_offsets[s], data.seq_offsets[s + 1]
        row = rows[int(data.source_index[s])]
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]
        ids, mask = _expected(tokenizer, messages)
        assert np.asarray(data.tokens[lo:hi]).tolist() == ids
        assert np.asarray(data.loss_mask[lo:hi]).tolist() == mask, messages


def test_repeated_reply_gets_two_labelled_spans(prepared, tokenizer):
    rows, data, _ = prepared
    s = int(np.flatnonzero(np.asarray(data.source_index) == 2)[0])
    lo, hi = data.seq_offsets[s], data.seq_offsets[s + 1]
    tokens, mask = np.asarray(data.tokens[lo:hi]), np.asarray(data.loss_mask[lo:hi]).astype(bool)
    runs = np.split(tokens[mask], np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    assert [tokenizer.decode(r) for r in runs] == ["Hello<|im_end|>\n", "<think>\n\n</think>\n\nHello<|im_end|>\n"]


def test_template_without_generation_blocks_is_refused(tmp_path, tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"cannot locate the assistant turns.*adds no assistant prompt"):
        prepare_packed_sequence_data(path, tokenizer, tmp_path, [512], chat_template=plain, progress=False,
                                     cache_dir=str(tmp_path / "cache"), log=lambda _: None)


TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Ask the tool.", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "21 C"},
        {"role": "assistant", "reasoning_content": "Report it.", "content": "\nIt is 21 degrees.  "},
    ],
    "tools": json.dumps([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]),
}


def test_prepare_renders_reasoning_tool_calls_and_tools(tmp_path, tokenizer):
    """A JSONL row with reasoning, a tool-call turn without text, a tool response and its tools (as a JSON string,
    as datasets store them): the packed tokens are apply_chat_template(messages, tools=...) exactly (old code:
    refused by the record check, and every field but role/content dropped), labels the two assistant turns as the
    template renders them (reasoning and tool call included), "<|im_start|>assistant\\n" and the tool response
    not."""
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(TOOL_CHAT) + "\n")
    written = prepare_packed_sequence_data(path, tokenizer, tmp_path, [512], tokenizer_name="t", progress=False,
                                           cache_dir=str(tmp_path / "cache"), log=lambda _: None)
    data = open_packed(written[0].path)
    tokens, mask = np.asarray(data.tokens[:data.seq_offsets[1]]), np.asarray(data.loss_mask[:data.seq_offsets[1]])
    messages = [{k: v for k, v in m.items() if v is not None} for m in TOOL_CHAT["messages"]]
    assert tokens.tolist() == tokenizer.apply_chat_template(messages, tools=json.loads(TOOL_CHAT["tools"]),
                                                            tokenize=True, return_dict=True)["input_ids"]
    runs = np.split(tokens[mask.astype(bool)], np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    assert [tokenizer.decode(r) for r in runs] == [
        '<think>\nAsk the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n",
        "<think>\nReport it.\n</think>\n\nIt is 21 degrees.  <|im_end|>\n"]


def test_record_check_allows_tool_call_turns_and_refuses_chats_without_any_answer():
    from vlm_pack.offline.encoding import SampleFormat

    fmt = SampleFormat(template="chat")
    fmt.check(TOOL_CHAT, "x.jsonl:1")
    fmt.check({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}]}, "x.jsonl:1")  # OpenAI's None content
    fmt.check({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "},
                            {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}, "x.jsonl:2")
    with pytest.raises(ValueError, match=r"x.jsonl:3: empty response \(no assistant message has content\)"):
        fmt.check({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}, "x.jsonl:3")
    with pytest.raises(ValueError, match=r"x.jsonl:4: field 'messages' must be a list of \{role, content\} strings"):
        fmt.check({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "c"}]},
                  "x.jsonl:4")


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_an_answer_that_is_reasoning_only_is_something_to_train_on(tokenizer, field):
    """An assistant turn whose only answer is its reasoning (empty content) passes prepare's record check and the
    collator's, and is labelled (the Qwen3 template writes reasoning_content into a think block; the other two
    fields it does not read, and the empty turn's end-of-turn token is still the answer)."""
    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.offline.encoding import SampleFormat

    chat = {"messages": [{"role": "user", "content": "Think about it."},
                         {"role": "assistant", field: "Nothing to add.", "content": ""}]}
    SampleFormat(template="chat").check(chat, "x.jsonl:1")
    batch = VLMPackingCollator(tokenizer, max_length=256)([chat])
    labels = batch["labels"][0]
    assert tokenizer.decode(labels[labels != -100]).endswith("<|im_end|>\n")
