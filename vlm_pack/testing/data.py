"""Real sample data available offline, as chat examples for the collator, tests, demo and benchmarks.

* ``sample_photos``: the classic photos bundled with scikit-image (astronaut, chelsea the cat, coffee, rocket).
* ``easy_vqa_examples``: the MIT-licensed ``easy-vqa`` set (64x64 shape images with question/answer pairs);
  images are given as file paths, the way datasets usually reference them.
* ``photo_examples``: questions about the photos, one to three images per sample, several sizes.
* ``text_chat_examples``: multi-turn text-only chats built from easy-vqa questions (varied lengths).

Both extra packages are the ``examples`` extra of vlm_pack; a clear ImportError says so when missing.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["PHOTO_NAMES", "easy_vqa_examples", "photo_examples", "sample_photos", "text_chat_examples"]

PHOTO_NAMES = ("astronaut", "chelsea", "coffee", "rocket")
_PHOTO_QUESTIONS = {
    "astronaut": ("Who is in the picture?", "An astronaut in a white suit, with a flag behind."),
    "chelsea": ("What animal is this?", "A tabby cat looking to the side."),
    "coffee": ("What is on the table?", "A cup of coffee on a saucer with a spoon."),
    "rocket": ("What is happening here?", "A rocket standing on the launch pad before lift-off."),
}


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = {"skimage.data": "scikit-image", "easy_vqa": "easy-vqa"}[module]
        raise ImportError(f"this data needs the PyPI package {package!r}: pip install 'vlm_pack[examples]'") from exc


def _fit(image: Image.Image, side: int) -> Image.Image:
    """``image`` resized (aspect kept) so that its longer side is ``side`` pixels."""
    scale = side / max(image.size)
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))


def sample_photos(max_side: int = 112) -> dict[str, Image.Image]:
    """The scikit-image photos as RGB PIL images, downscaled so the longer side is ``max_side`` pixels."""
    skdata = _require("skimage.data")
    return {name: _fit(Image.fromarray(getattr(skdata, name)()).convert("RGB"), max_side) for name in PHOTO_NAMES}


def photo_examples(n: int, *, seed: int = 0, max_side: int = 112) -> list[dict]:
    """``n`` chat examples about the photos: 1-3 images each, resized to varied sizes (different token counts)."""
    photos = sample_photos(max_side)
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        names = rng.choice(PHOTO_NAMES, size=int(rng.integers(1, 4)), replace=False)
        content: list[dict] = []
        for name in names:
            side = int(rng.choice([56, 84, max_side]))
            content.append({"type": "image", "image": _fit(photos[name], side)})
        questions = " ".join(_PHOTO_QUESTIONS[name][0] for name in names)
        answer = " ".join(_PHOTO_QUESTIONS[name][1] for name in names)
        content.append({"type": "text", "text": questions})
        examples.append(
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}
        )
    return examples


def easy_vqa_examples(n: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """``n`` easy-vqa question/answer pairs as chat examples; the image is referenced by its file path."""
    easy_vqa = _require("easy_vqa")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}")
    questions, answers, image_ids = getattr(easy_vqa, f"get_{split}_questions")()
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(questions), size=min(n, len(questions)), replace=False)
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "path": paths[image_ids[i]]}, {"type": "text", "text": questions[i]}],
                },
                {"role": "assistant", "content": answers[i]},
            ]
        }
        for i in picks
    ]


def text_chat_examples(n: int, *, seed: int = 0, max_turns: int = 8) -> list[dict]:
    """``n`` text-only chats of 1..``max_turns`` question/answer rounds (Zipf-like: mostly short, a few long)."""
    easy_vqa = _require("easy_vqa")
    questions, answers, _ = easy_vqa.get_train_questions()
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        rounds = int(min(max_turns, rng.zipf(2.0)))
        messages = []
        for i in rng.choice(len(questions), size=rounds, replace=False):
            messages.append({"role": "user", "content": questions[i].capitalize()})
            messages.append({"role": "assistant", "content": f"The answer is {answers[i]}."})
        examples.append({"messages": messages})
    return examples
