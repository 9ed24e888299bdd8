"""Gemma 3n text model (``Gemma3nForCausalLM``, ``gemma3n_text``): causal attention with sliding-window and full
layers, KV sharing across the last layers, per-layer input embeddings, AltUp, LAuReL and activation sparsity.

Rules (proven in tests/test_families_round3a.py against each sample alone through the stock sdpa model): attention
never crosses a sample and keeps each layer's window inside it; KV-shared layers reuse the keys and values of an
earlier layer of the same forward, so they see the same samples; per-layer embeddings (looked up from the token
ids), AltUp predictions / corrections, LAuReL and the Gaussian top-k activation sparsity all act per token; 1-D
positions restart per sample. Final logit softcapping acts on logits only.

Not registered: the composite ``gemma3n`` (vision + audio). Its vision tower is timm's MobileNetV5, which needs the
PyPI package timm (not installed in the proof environment, so the model cannot be built there), and its audio
tower (a conformer over per-sample mel features) has no packed proof; see ``vlm_pack.models.missing``.
"""

from . import FamilySpec, register_family

GEMMA3N_TEXT = register_family(FamilySpec(
    name="gemma3n_text", model_types=("gemma3n_text",), proof="tests/test_families_round3a.py",
    min_transformers="5.24",  # proven on 5.24 only (registered in round 3, never run on the floor)
    layer_kinds=frozenset({"full_attention", "sliding_attention"}),
))
