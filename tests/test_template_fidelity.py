"""Data fidelity: the model's OWN chat template, labels on exactly what it must learn, images as transformers
loads them.

References are independent of vlm_pack's rendering: tokens are ``processor.apply_chat_template(...,
tokenize=True)`` with the official template (TRL's copy in ``trl/chat_templates/``), labels are the assistant mask
of TRL's training variant of that template (HF's ``return_assistant_tokens_mask``), with the image / video
tokens each family's processor writes (listed here from transformers' processor code) removed.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.image_utils import load_image as hf_load_image

from vlm_pack.data.chat import carry_assistant_mask, load_image
from vlm_pack.core.versions import has
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import get_family
from vlm_pack.offline.encoding import SampleEncoder, SampleFormat
from vlm_pack.testing.tiny_families import TINY_VLM_FAMILIES, tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import (
    offline_gemma3_processor, offline_qwen2vl_processor, official_template, qwen_tokenizer, tiny_config, tiny_model,
)

from tolerance import assert_grads_close
from version_gates import require_proven

IGNORE = -100

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(seed: int, size=(48, 40)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _text(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def conversations() -> list[list[dict]]:
    """Multi-turn with a system prompt, one image; single turn without one; two images in one turn."""
    return [
        [{"role": "system", "content": _text("You answer in one line.")},
         {"role": "user", "content": [{"type": "image", "image": _image(0)}, *_text("What is this?")]},
         {"role": "assistant", "content": _text("Noise.")},
         {"role": "user", "content": _text("Which colours?")},
         {"role": "assistant", "content": _text("All of them.")}],
        [{"role": "user", "content": [{"type": "image", "image": _image(1, (40, 64))}, *_text("Describe.")]},
         {"role": "assistant", "content": _text("A tall picture.")}],
        [{"role": "user", "content": _text("Hi there.")},
         {"role": "assistant", "content": _text("Hello.")},
         {"role": "user", "content": [{"type": "image", "image": _image(2)}, {"type": "image", "image": _image(3)},
                                      *_text("Same?")]},
         {"role": "assistant", "content": _text("No.")}],
    ]


def reference(processor, conversation: list[dict], official: str, training: str) -> tuple[list[int], list[int] | None]:
    """(token ids of the official template, labels from TRL's training variant) of one conversation; labels None
    where TRL's variant renders the conversation differently (Qwen3.5 keeps every turn's think block)."""
    ids = processor.apply_chat_template(conversation, chat_template=official, tokenize=True, return_dict=True)
    ids = np.asarray(ids["input_ids"]).reshape(-1).tolist()
    marked = processor.apply_chat_template(conversation, chat_template=training, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    if np.asarray(marked["input_ids"]).reshape(-1).tolist() != ids:
        return ids, None
    mask = np.asarray(marked["assistant_masks"]).reshape(-1).astype(bool)
    labels = [token if keep else IGNORE for token, keep in zip(ids, mask)]
    labels[0] = IGNORE
    return ids, labels


def segments(batch: dict, key: str) -> list[list[int]]:
    cu = batch["vlm_pack"]["cu_seqlens"].tolist()
    return [batch[key][0, a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]


# (official template, the processor and model config it is tried with). Qwen3-VL's template on the Qwen2-VL
# processor: the same tokenizer and image placeholders, the Qwen3-VL family's own template text.
TEMPLATE_CASES = {
    "qwen2_5_vl": (lambda: offline_qwen2vl_processor(), "qwen2_5_vl"),
    "qwen3_vl": (lambda: offline_qwen2vl_processor(), "qwen3_vl"),
    "qwen3_5_nothink": (lambda: offline_qwen2vl_processor(), "qwen3_5_nothink"),
    "gemma3": (lambda: offline_gemma3_processor(), "gemma3"),
    "idefics3": (lambda: tiny_vlm_processor("idefics3"), None),
    "smolvlm": (lambda: tiny_vlm_processor("smolvlm"), None),
}
_CONFIGS = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_5_nothink": "qwen3_5", "gemma3": "gemma3"}


def _config(name: str, processor):
    if name in _CONFIGS:
        return tiny_config(_CONFIGS[name])
    return tiny_vlm(name, processor, layers=1).config


@pytest.mark.parametrize("name", list(TEMPLATE_CASES))
def test_collator_tokens_are_the_official_templates_and_labels_trls(name):
    """Packed and padded: every sample's tokens == apply_chat_template with the official template, labels ==
    TRL's training-variant mask (first slot -100). Old code: the Qwen processors fell back to vlm_pack's
    ChatML (no default system prompt), Gemma / Idefics3 / SmolVLM needed a hand-written marked template."""
    build, given = TEMPLATE_CASES[name]
    processor = build()
    official = official_template(name)
    if given is None:
        assert processor.chat_template == official  # the shipped tiny processor carries it
    training = official_template(f"{name}_training")
    config = _config(name, processor)
    if not has("processor_mask_shift") and get_family(config).encoding.expansion_writes_text:
        with pytest.raises(ValueError, match=r"transformers>=5\.23"):  # the mask cannot be carried: refused
            VLMPackingCollator(processor, max_length=4096, model_config=config)
        return
    chat_template = official if given is not None else None
    examples = [{"messages": c} for c in conversations()]
    expected = [reference(processor, c, official, training) for c in conversations()]
    assert sum(labels is not None for _, labels in expected) >= 1  # the single-turn one at least
    packed = VLMPackingCollator(processor, max_length=4096, model_config=config, chat_template=chat_template)
    batch = packed(examples)
    assert segments(batch, "input_ids") == [ids for ids, _ in expected]
    for conversation, (_, labels), ids, got in zip(conversations(), expected, segments(batch, "input_ids"),
                                                   segments(batch, "labels")):
        if labels is not None and not has("processor_mask_shift") and _has_image(conversation):
            # the reference is the processor's mask, unshifted for expanded images before transformers 5.23: the
            # collator's carried mask is proven there by test_image_inside_an_assistant_turn_is_never_a_target
            # (an independent answer span) and equal to the shifted one on 5.23+ (tests/test_vlm_families.py)
            assert any(token != IGNORE for token in got)
        elif labels is not None:
            assert got == labels
        else:  # sentinel spans: one labelled run per answer, holding it
            answers = [m["content"][0]["text"] for m in conversation if m["role"] == "assistant"]
            runs = _runs(ids, got, processor.tokenizer)
            assert len(runs) == len(answers) and all(a in r for a, r in zip(answers, runs)), runs
    padded = VLMPackingCollator(processor, max_length=4096, model_config=config, chat_template=chat_template,
                                pack_sequences_in_batch=False)
    batch = padded(examples)
    for row, (ids, labels) in enumerate(expected):
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert labels is None or batch["labels"][row, : len(ids)].tolist() == labels or (
            not has("processor_mask_shift") and _has_image(conversations()[row]))


def _has_image(conversation: list[dict]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in conversation)


def test_default_system_prompt_of_the_official_template_is_kept():
    """The official Qwen2.5-VL template writes "You are a helpful assistant." when no system turn is given."""
    processor = offline_qwen2vl_processor()
    collator = VLMPackingCollator(processor, max_length=4096, model_config=tiny_config("qwen2_5_vl"))
    text = processor.tokenizer.decode(collator([{"messages": conversations()[1]}])["input_ids"][0])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")


# ------------------------------------------------------------------ a template TRL does not know: sentinels


TEXT_CHATS = [
    [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again"},
     {"role": "assistant", "content": "Bye"}],
]


def _runs(ids: list[int], labels: list[int], tokenizer) -> list[str]:
    keep = np.asarray(labels) != IGNORE
    idx = np.flatnonzero(keep)
    return [tokenizer.decode(np.asarray(ids)[r]) for r in np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1)]


@pytest.fixture(scope="module")
def qwen_tok():
    return qwen_tokenizer()


def test_shipped_qwen_tokenizer_keeps_its_own_template_in_the_collator_and_prepare(qwen_tok):
    """The shipped Qwen tokenizer's own template (a Qwen3 template TRL has no training variant of): tokens ==
    its apply_chat_template; labels == TRL's Qwen3 training-variant mask where the two render the same text
    (a single turn), and on a multi-turn chat exactly each answer after its "<|im_start|>assistant\\n" through
    "<|im_end|>\\n" (the final one with the empty think block the template writes). Collator and prepare agree."""
    tokenizer = qwen_tok
    collator = VLMPackingCollator(tokenizer, max_length=512)
    batch = collator([{"messages": c} for c in TEXT_CHATS])
    encoder = SampleEncoder(tokenizer, SampleFormat(template="chat"), None)
    prepared_ids, masks = encoder.encode([{"messages": c} for c in TEXT_CHATS], ["row 0", "row 1"])
    for chat, ids, labels, offline_ids, mask in zip(TEXT_CHATS, segments(batch, "input_ids"),
                                                    segments(batch, "labels"), prepared_ids, masks):
        assert ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert offline_ids == ids
        assert [t if m else IGNORE for t, m in zip(ids, mask)][1:] == labels[1:]
    single = tokenizer.apply_chat_template(TEXT_CHATS[0], chat_template=official_template("qwen3_training"),
                                           tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert single["input_ids"] == segments(batch, "input_ids")[0]
    assert [t if m else IGNORE for t, m in zip(single["input_ids"], single["assistant_masks"])] == \
        segments(batch, "labels")[0]
    ids, labels = segments(batch, "input_ids")[1], segments(batch, "labels")[1]
    assert _runs(ids, labels, tokenizer) == ["Hello there<|im_end|>\n", "<think>\n\n</think>\n\nBye<|im_end|>\n"]


def _random_chats(n: int, seed: int) -> list[list[dict]]:
    """Chats of 1-3 turns, with and without a system prompt; answers with edge whitespace, newlines, unicode."""
    rng = np.random.default_rng(seed)
    words = ["sky", " blue", "\n", "Ünïcode", "日本語", "🙂", "  ", "x" * 7, ".", "<|im_start|>"[:2], "ok"]

    def text() -> str:
        return "".join(rng.choice(words, rng.integers(1, 8))).strip() or "ok"

    chats = []
    for _ in range(n):
        chat = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.integers(1, 4)):
            chat += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        chats.append(chat)
    return chats


def test_prepare_masks_follow_hugging_faces_overlap_rule(qwen_tok):
    """``prepare`` computes its masks from the token offsets in one vectorised pass (no third rendering): on random
    chats its tokens equal ``apply_chat_template``'s and its mask equals, token by token, HF's rule (a token is
    marked when it overlaps an assistant span) with the spans found here by plain string search: each assistant
    turn runs from the end of "<|im_start|>assistant\n" through "<|im_end|>\n" (the template's generation prompt
    and terminator; the final turn keeps the empty think block the template writes)."""
    chats = _random_chats(40, seed=4)
    encoder = SampleEncoder(qwen_tok, SampleFormat(template="chat"), None)
    ids, masks = encoder.encode([{"messages": c} for c in chats], [f"row {i}" for i in range(len(chats))])
    head, tail = "<|im_start|>assistant\n", "<|im_end|>\n"
    for chat, sample_ids, mask in zip(chats, ids, masks):
        text = qwen_tok.apply_chat_template(chat, tokenize=False)
        assert sample_ids == qwen_tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        spans, start = [], 0
        while (start := text.find(head, start)) >= 0:
            begin = start + len(head)
            start = text.index(tail, begin) + len(tail)
            spans.append((begin, start))
        assert len(spans) == sum(m["role"] == "assistant" for m in chat)
        offsets = qwen_tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        expected = [int(any(end > b and begin < e for b, e in spans)) for begin, end in offsets]
        assert mask.tolist() == expected


def _template(answer: str) -> str:
    return ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ " + answer + " if m.role == 'assistant' else "
            "m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_assistant_text_is_labelled_where_it_renders_it(qwen_tok):
    """Sentinels cannot locate an answer the template rewrites (upper-cased) or trims (surrounding spaces); prefix
    renderings do: the label is the turn as the template renders it (old code: refused, the trimmed one only
    when the batch was built)."""
    upper = VLMPackingCollator(qwen_tok, max_length=512, chat_template=_template("m.content | upper"))
    batch = upper([{"messages": TEXT_CHATS[1]}])
    assert _runs(batch["input_ids"][0].tolist(), batch["labels"][0].tolist(), qwen_tok) == [
        "HELLO THERE<|im_end|>\n", "BYE<|im_end|>\n"]
    trim = VLMPackingCollator(qwen_tok, max_length=512, chat_template=_template("m.content | trim"))
    spaced = [TEXT_CHATS[0][0], {"role": "assistant", "content": " Yes. "}]
    batch = trim([{"messages": TEXT_CHATS[0]}, {"messages": spaced}])
    assert [_runs(ids, labels, qwen_tok) for ids, labels in zip(segments(batch, "input_ids"),
                                                                 segments(batch, "labels"))] == [
        ["Yes.<|im_end|>\n"], ["Yes.<|im_end|>\n"]]


def test_a_template_no_method_can_label_is_refused_when_built_naming_the_feature(qwen_tok):
    """Truly ambiguous: the last answer upper-cased (an earlier turn renders differently once more follow: not
    prefix-preserving), turns ending in a plain newline (no end-of-turn token), no TRL variant. Refused when the
    collator / encoder is built, naming the feature, not mid-training."""
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content | upper if (loop.last and m.role == 'assistant') "
                "else m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    match = (r"the chat_template passed in is refused for chats with a system turn and several turns: cannot "
             r"locate the assistant turns .*not prefix-preserving")
    with pytest.raises(ValueError, match=match):
        VLMPackingCollator(qwen_tok, max_length=512, chat_template=template)
    with pytest.raises(ValueError, match=match):
        SampleEncoder(qwen_tok, SampleFormat(template="chat"), None, chat_template=template)


# ------------------------------------------------------------------ roles and empty labels


def test_unknown_role_is_an_error_in_the_collator_and_prepare(qwen_tok):
    """Old code: "Assistant" silently lost its labels (only the second answer was labelled)."""
    chat = [{"role": "user", "content": "a"}, {"role": "Assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    collator = VLMPackingCollator(qwen_tok, max_length=512)
    with pytest.raises(ValueError, match=r"sample 1, turn 1: unknown role 'Assistant'; accepted roles: system, user, "
                                         r"assistant, tool"):
        collator([{"messages": TEXT_CHATS[0]}, {"messages": chat}])
    with pytest.raises(ValueError, match=r"data.jsonl:3, turn 1: unknown role 'Assistant'"):
        SampleFormat(template="chat").check({"messages": chat}, "data.jsonl:3")


EMPTY_ANSWERS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                 "{% endgeneration %}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")


def test_sample_or_batch_without_labels_is_refused_or_counted(qwen_tok):
    """A template whose generation blocks are empty gives samples with 0 label tokens: an error naming the
    sample (old code: a batch with 0 label tokens, no warning), or counted and dropped with on_empty='drop'."""
    examples = [{"messages": c} for c in TEXT_CHATS]
    with pytest.raises(ValueError, match="sample 0 has no label token.*on_empty='drop'"):
        VLMPackingCollator(qwen_tok, max_length=512, chat_template=EMPTY_ANSWERS)(examples)
    dropping = VLMPackingCollator(qwen_tok, max_length=512, chat_template=EMPTY_ANSWERS, on_empty="drop")
    with pytest.warns(UserWarning, match="dropped 2 of 2 samples without any label"), \
            pytest.raises(ValueError, match="2 have no label"):
        dropping(examples)
    mixed = VLMPackingCollator(qwen_tok, max_length=512, on_empty="drop")
    with pytest.raises(ValueError, match="on_empty must be 'error' or 'drop'"):
        VLMPackingCollator(qwen_tok, max_length=512, on_empty="keep")
    assert mixed(examples)["vlm_pack"]["stats"].samples_dropped == 0


# ------------------------------------------------------------------ images inside an assistant turn, every family

# What each family's processor writes for an image (transformers' processing_<family>.py): never a target.
MEDIA_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "llava_onevision": ["<image>"],
    "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "internvl": ["<img>", "<IMG_CONTEXT>", "</img>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)],
    "glm4v": ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>"],
}
MEDIA_TOKENS["smolvlm"] = MEDIA_TOKENS["idefics3"]
MEDIA_TOKENS["idefics2"] = ["<image>", "<fake_token_around_image>"]
MEDIA_TOKENS.update({name: MEDIA_TOKENS["qwen2_vl"] for name in ("qwen3_vl_moe", "qwen3_5_moe", "lighton_ocr")})
MEDIA_TOKENS.update({name: MEDIA_TOKENS["glm4v"] for name in ("glm4v_moe", "glm46v", "glm_ocr")})
MEDIA_TOKENS.update({name: ["<image>"] for name in ("llava", "llava_next", "llava_next_video", "vipllava", "video_llava")})
MEDIA_TOKENS.update({name: ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
                     for name in ("aya_vision", "cohere2_vision")})
MEDIA_TOKENS.update({name: ["<image_placeholder>"] for name in ("deepseek_vl", "deepseek_vl_hybrid")})
# Families with tests of their own (tests/test_family_<family>.py).
MEDIA_TOKENS.update({name: ["<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"] for name in ("paddleocr_vl", "ernie4_5_vl_moe")})
MEDIA_TOKENS["ovis2"] = ["<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
MEDIA_TOKENS.update({name: ["<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>"] for name in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")})
MEDIA_TOKENS["aria"] = ["<|img|>"]
MEDIA_TOKENS["qianfan_ocr"] = ["<img>", "<IMG_CONTEXT>", "</img>"]
MEDIA_TOKENS["lfm2_vl"] = ["<|image_start|>", "<image>", "<|image_end|>"]
MEDIA_TOKENS["hunyuan_vl"] = ["<｜hy_place▁holder▁no▁100｜>", "<｜hy_place▁holder▁no▁102｜>", "<｜hy_place▁holder▁no▁101｜>"]
MEDIA_TOKENS["minicpmv4_6"] = ["<image>", "<|image_pad|>", "</image>", "<slice>", "</slice>"]
MEDIA_TOKENS["minicpmv4_7"] = MEDIA_TOKENS["minicpmv4_6"]
MEDIA_TOKENS["molmo2"] = ["<low_res_im_start>", "<im_start>", "<im_patch>", "<im_col>", "<im_end>"]
# Round-4 families (issue 47; tests/test_family_<family>.py).
MEDIA_TOKENS.update({"video_llama_3": ["<|image_pad|>"], "kimi_k25": ["<|media_pad|>"],
                     "gemma4_unified": ["<|image>", "<|image|>", "<image|>"], "mistral4": MEDIA_TOKENS["mistral3"],
                     "lfm3_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                     "nemotron_h_omni": ["<img>", "<image>", "</img>"],
                     "hyperclovax_vision_v2": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
# Image markup that holds plain text: Aya Vision's tile labels "TILE_1", ... between its start/end markers.
# MiniCPM-V's per-sample image number "N" between <image_id> and </image_id>.
MEDIA_SPANS = {"aya_vision": ("<|START_OF_IMG|>", "<|END_OF_IMG|>"), "minicpmv4_6": ("<image_id>", "</image_id>"),
               "minicpmv4_7": ("<image_id>", "</image_id>")}
# Gemma 4 unified renders with the official Gemma 4 template, of which TRL ships no training variant (no reference mask
# here): its labels are checked against the template's answers in tests/test_family_gemma4_unified.py.
LABEL_FAMILIES = ["qwen2_vl", "gemma3", *(f for f in TINY_VLM_FAMILIES if f != "gemma4_unified")]


def _family(name: str):
    """(processor, stock sdpa model with one layer) of a family."""
    if name in ("qwen2_vl", "gemma3"):
        processor = offline_qwen2vl_processor() if name == "qwen2_vl" else offline_gemma3_processor()
        return processor, tiny_model(name, layers=1)
    require_proven(name)
    processor = tiny_vlm_processor(name)
    return processor, tiny_vlm(name, processor, layers=1)


def _assistant_image_chat() -> list[dict]:
    return [{"role": "user", "content": _text("Draw a square and describe it.")},
            {"role": "assistant", "content": [*_text("Here it is:"), {"type": "image", "image": _image(7, (56, 56))},
                                              *_text("a noisy square.")]}]


def _training_template(processor) -> str:
    """The template whose generation blocks give the reference mask: the processor's own if marked, else TRL's."""
    own = processor.chat_template
    if "{% generation %}" in own or "{%- generation -%}" in own:  # marked: vlm_pack's ChatML stand-in, LFM2.5-VL's
        return own
    name = next(n for n in ("qwen2_5_vl", "gemma3", "idefics3", "smolvlm") if official_template(n) == own)
    return official_template(f"{name}_training")


def _answer_span(processor, chat: list[dict], length: int, newline: bool = False) -> torch.Tensor:
    """Mask of the answer (its text and <|im_end|>) among the ``length`` tokens of ``chat`` (one user turn, then the
    answer; ChatML) encoded by the processor: from the end of the processor's own tokens of the prompt
    (add_generation_prompt) to the end of its tokens of the chat without the template's final newline (with it:
    ``newline``, as TRL's training variants label it). Independent
    of any assistant mask: the processor expands images in the text alone."""
    prompt = processor.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
    full = processor.apply_chat_template(chat, tokenize=False)
    assert full.endswith("<|im_end|>\n")
    images = [load_image(part["image"], "answer") for message in chat if isinstance(message["content"], list)
              for part in message["content"] if part["type"] == "image"]

    def count(text: str) -> int:  # the processor expands the text's images (given, as transformers 5.17 needs)
        kwargs = {"images": images} if images and text != prompt else {}
        return len(processor(text=[text], **kwargs)["input_ids"][0])

    start, end = count(prompt), count(full if newline else full[:-1])
    assert count(full) == length
    return (torch.arange(length) >= start) & (torch.arange(length) < end)


def test_idefics2_mask_carried_through_the_expansion_is_needed():
    """Corruption: Idefics2's processor mask (computed before its image expansion) taken as is labels the image's
    markers and misses the answer's last tokens, so it differs from the answer span the collator labels."""
    processor, model = _family("idefics2")
    chat = _assistant_image_chat()
    out = processor.apply_chat_template([chat], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = torch.as_tensor(out["input_ids"][0])
    own = torch.as_tensor(out["assistant_masks"][0]).bool()
    answer = _answer_span(processor, chat, len(ids))
    media = torch.isin(ids, torch.tensor(processor.tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["idefics2"])))
    labels = VLMPackingCollator(processor, max_length=4096, model_config=model.config)([{"messages": chat}])["labels"]
    assert torch.equal(labels[0][1:] != IGNORE, (answer & ~media)[1:])
    assert not torch.equal(own & ~media, answer & ~media)
    assert (answer & ~media & ~own).any()  # answer tokens the processor's mask leaves unlabelled


def test_carried_mask_fails_closed():
    """carry_assistant_mask (ids: 9 the placeholder, 8 a marker): equal text maps one to one, a re-tokenised head
    takes its tokens' mask, added tokens (a BOS) the next token's; a head straddling an assistant border, or image
    runs that do not match the placeholders, are refused naming the sample."""
    media = {8, 9}
    assert carry_assistant_mask([1, 9, 2, 3], [0, 1, 1, 1], [1, 8, 9, 9, 8, 4, 5, 3], media, "sample 0") == [
        0, 0, 0, 0, 0, 1, 1, 1]
    assert carry_assistant_mask([1, 2], [0, 1], [0, 1, 2], media, "sample 0") == [0, 0, 1]
    with pytest.raises(ValueError, match="sample 3: the processor re-tokenised text"):
        carry_assistant_mask([9, 2, 3], [0, 0, 1], [8, 9, 8, 4, 5], media, "sample 3")
    with pytest.raises(ValueError, match="sample 2: the processor wrote 2 image runs for 1 runs"):
        carry_assistant_mask([9, 9, 2], [0, 0, 1], [8, 9, 8, 2, 8, 9, 8, 2], media, "sample 2")


@pytest.mark.parametrize("name", LABEL_FAMILIES)
def test_image_inside_an_assistant_turn_is_never_a_target(name):
    """Labels == the reference mask without the family's image tokens; gradients of the packed model on the
    collator's batch equal the stock model's on the sample alone with those reference labels (tolerance.py's
    assert_grads_close: rel. L2 < 1e-4, gradients zero in exact arithmetic measured against the largest).
    Old code: InternVL, LLaVA-OneVision, Mistral3, Idefics3, SmolVLM labelled the placeholders (their processors
    return no mm_token_type_ids) and Qwen-VL / GLM-4V the vision start/end markers."""
    processor, model = _family(name)
    family = get_family(model.config)
    if not has("processor_mask_shift") and family.encoding.expansion_writes_text:
        with pytest.raises(ValueError, match=r"transformers>=5\.23"):  # the mask cannot be carried: refused
            VLMPackingCollator(processor, max_length=4096, model_config=model.config)
        return
    chat = _assistant_image_chat()
    template = _training_template(processor)
    if family.encoding.template_prefix is not None:  # what the processor would put first AFTER recording the mask, shifting
        template = "{% raw %}" + family.encoding.template_prefix(processor) + "{% endraw %}" + template  # it (Molmo 2's BOS)
    out = processor.apply_chat_template([chat], chat_template=template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt")
    ids = out["input_ids"][0]
    media = torch.tensor(processor.tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[name]))
    assistant = torch.as_tensor(out["assistant_masks"][0]).bool()
    if family.encoding.mask_before_expansion or not has("processor_mask_shift"):  # the processor's mask is off by the expansion
        # TRL's training variants (the official templates) label the newline after the end-of-turn token too
        trl_variant = _training_template(processor) != processor.chat_template
        assistant = _answer_span(processor, chat, len(ids), newline=trl_variant)
    inside = torch.isin(ids, media).nonzero()
    labelled = assistant.nonzero()
    assert len(inside) and labelled.min() < inside.min() and inside.max() < labelled.max()  # inside the answer
    keep = assistant & ~torch.isin(ids, media)
    if name in MEDIA_SPANS:  # everything from the start marker through the end marker
        start, end = processor.tokenizer.convert_tokens_to_ids(MEDIA_SPANS[name])
        ids_list, inside_span = ids.tolist(), False
        for i, token in enumerate(ids_list):
            inside_span = inside_span or token == start
            if inside_span:
                keep[i] = False
            inside_span = inside_span and token != end
        assert (~keep & assistant & ~torch.isin(ids, media)).any()  # plain-text tile labels inside the answer
    labels = ids.masked_fill(~keep, IGNORE)
    labels[0] = IGNORE

    collator = VLMPackingCollator(processor, max_length=4096, model_config=model.config)
    batch = collator([{"messages": chat}])
    assert torch.equal(batch["input_ids"][0], ids)
    assert torch.equal(batch["labels"][0], labels)

    # The stock model first (the reference), then the same weights after enable_packing on the collator's batch.
    inputs = {k: v for k, v in out.items() if k not in ("assistant_masks", "attention_mask")}
    ref_logits = model(**inputs, use_cache=False).logits[0]
    F.cross_entropy(ref_logits[:-1], labels[1:], ignore_index=IGNORE).backward()
    reference = {key: param.grad.clone() for key, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    packed = enable_packing(model)
    logits = packed(**{k: v for k, v in batch.items() if k not in ("labels", "vlm_pack")}, use_cache=False).logits[0]
    F.cross_entropy(logits[:-1], batch["labels"][0][1:], ignore_index=IGNORE).backward()
    assert_grads_close({key: param.grad for key, param in packed.named_parameters() if key in reference}, reference)


# ------------------------------------------------------------------ EXIF orientation


def _rotated_jpeg() -> bytes:
    """A 80x40 (w x h) JPEG whose EXIF orientation (6) says: rotate 90 degrees clockwise to view it."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    _image(5, (80, 40)).save(buffer, format="JPEG", exif=exif.tobytes(), quality=95)
    return buffer.getvalue()


def test_exif_orientation_is_applied_like_transformers_load_image(tmp_path, processor):
    """Paths, bytes and PIL images: pixels and image grid equal transformers' load_image (old code: [1, 4, 8] for
    a phone photo that transformers reads as [1, 8, 4])."""
    data = _rotated_jpeg()
    path = tmp_path / "phone.jpg"
    path.write_bytes(data)
    expected = hf_load_image(str(path))
    assert expected.size == (40, 80)
    grid = processor.image_processor(images=[expected], return_tensors="pt")["image_grid_thw"]
    collator = VLMPackingCollator(processor, max_length=4096, model_config=tiny_config("qwen2_vl"))
    for payload in (str(path), data, Image.open(io.BytesIO(data))):
        image = load_image(payload, "test")
        assert np.array_equal(np.asarray(image), np.asarray(expected))
        chat = [{"role": "user", "content": [{"type": "image", "image": payload}, *_text("?")]},
                {"role": "assistant", "content": "!"}]
        assert torch.equal(collator([{"messages": chat}])["image_grid_thw"], grid)
