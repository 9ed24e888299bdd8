"""Mistral 4 language model (``mistral4``: multi-head latent attention, mixture of experts), on its own
(``Mistral4ForCausalLM``) or inside a Mistral3 VLM (Pixtral vision, vlm_pack/models/mistral.py): causal, 1-D
positions per sample.

Rules (proven in tests/test_family_mistral4.py through a Mistral3 VLM with a Mistral 4 language model, against each
sample alone through the stock sdpa model): the latent attention's queries / keys (low-rank projections, a decoupled
interleaved rope part) reach the attention function like any other, whose value head size differs from the query's
(handled); YaRN RoPE depends on the position id alone (its frequencies are fixed at construction, never rescaled by
the sequence length), and the Llama-4 attention scaling (``llama_4_scaling_beta``) reads the position ids, which
restart per sample; routing is per token. ``output_router_logits`` is refused (the router loss is not proven here).
"""

from .registry import register_family
from .spec import STATIC_ROPE_TYPES, FamilySpec, ModelRules, Proof

MISTRAL4 = register_family(FamilySpec(
    name="mistral4", model_types=("mistral4",),
    proof=Proof("tests/test_family_mistral4.py",
                min_transformers="5.24"),  # proven on 5.24 and 5.25 only (registered in round 4)
    model=ModelRules(rope_types=STATIC_ROPE_TYPES | {"yarn"}),
))
