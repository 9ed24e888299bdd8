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
