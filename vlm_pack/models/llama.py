"""Llama-style decoder-only text models (Llama, Qwen2, Qwen3): causal attention, 1-D positions per sample.

Proven in tests/test_families.py (packed row vs each sample alone through the stock sdpa model). Sliding-window
layers (Qwen2/Qwen3 ``use_sliding_window``) are not yet proven, so ``layer_kinds`` refuses them.
"""

from . import FamilySpec, register_family

_PROOF = "tests/test_families.py"

LLAMA = register_family(FamilySpec(name="llama", model_types=("llama",), proof=_PROOF))
QWEN2 = register_family(FamilySpec(name="qwen2", model_types=("qwen2",), proof=_PROOF))
QWEN3 = register_family(FamilySpec(name="qwen3", model_types=("qwen3",), proof=_PROOF))
