"""Shared pieces of the preference tests (DPO and reward): data, a small text tokenizer, gradient capture."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from vlm_pack.testing.data import _fit, sample_photos
from tolerance import GRAD_REL_L2

TOLERANCE = GRAD_REL_L2  # a stated relative bound (tests/tolerance.py): fp32 noise here is ~5e-7 (gradients), ~1e-7 (losses)
SIDES = (56, 84, 112, 70)  # Qwen: 4, 9, 16 and 6 merged image tokens


def pair_examples(images: bool) -> list[dict]:
    """Four preference pairs: different prompts, completion lengths and (optionally) image sizes."""
    photos = sample_photos()
    names = sorted(photos)
    out = []
    for i in range(4):
        text = f"What is shown in picture {i}?"
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}] if images else text}]
        example = {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "A photo of something nice" + " really" * (2 * i)}],
            "rejected": [{"role": "assistant", "content": "No idea" + "!" * (3 - i % 3)}],
        }
        if images:
            example["images"] = [_fit(photos[names[i]], SIDES[i])]
        out.append(example)
    return out


_WORDS = ("<pad> <|im_start|> <|im_end|> user assistant what is shown in picture ? a photo of something nice really no "
          "idea ! 0 1 2 3")


def word_tokenizer():
    """A 24-word tokenizer with a chat template, for the text model: TRL tokenises text datasets with
    ``datasets.map``, which hashes the tokenizer (the 151k-entry Qwen vocabulary takes 10-60 s here)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = _WORDS.split()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return tokenizer


class GradientsAtStep(TrainerCallback):
    """Gradients of the accumulated step, read just before the optimizer applies them."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    return (num / sum(float((a[k] ** 2).sum()) for k in a)) ** 0.5
