"""Gemma 3: causal text attention, each image's tokens bidirectional, sliding windows on local layers.

Rules (proven in tests/test_gemma3.py against each sample alone through the stock sdpa model):

* attention inside a sample is ``(causal OR same image block) AND sliding window`` on ``sliding_attention``
  layers and ``causal OR same image block`` on ``full_attention`` layers; never across samples. Image blocks
  are the runs of ``token_type_ids == 1`` (the image soft tokens; ``<start_of_image>`` / ``<end_of_image>``
  stay causal), exactly as ``Gemma3Model`` builds them for its own mask;
* ``token_type_ids`` is per token (the collator packs it like ``input_ids``); ``enable_packing`` reads it from
  the ``Gemma3Model`` forward and hands the block ids to our attention (HF's own packed mask gets the sliding
  layers wrong: it looks block ids up by position id, so every sample reuses the first sample's blocks);
* positions restart at 0 per sample (1-D); local and global RoPE bases depend on the position only;
* ``query_pre_attn_scalar`` reaches the attention as ``scaling``; final logit softcapping acts on logits only.
  ``attn_logit_softcapping`` is stored in the config but not passed to the attention by transformers 5.23 (so
  stock and packed agree); if a later version passes it, our attention refuses it.

Refused: ``use_bidirectional_attention=True`` (the embedding variant: no causal mask and a different window);
context parallelism (the zigzag split does not carry image-block ids yet).
``Gemma3ForCausalLM`` (text-only, ``gemma3_text``) uses the same spec without image blocks.
"""

from __future__ import annotations

from typing import Any

from .registry import register_family, text_config
from .spec import EncodingRules, FamilySpec, ImageBlockRule, ModelRules, Proof

_PROOF = "tests/test_gemma3.py"
_LAYER_KINDS = frozenset({"full_attention", "sliding_attention"})

IMAGE_BLOCKS = ImageBlockRule(
    token_key="token_type_ids", block_types=(1,), layer_types=_LAYER_KINDS, model_class="Gemma3Model"
)


def _image_blocks(config: Any) -> ImageBlockRule | None:
    return IMAGE_BLOCKS if getattr(config, "vision_config", None) is not None else None


def _causal_only(config: Any) -> str | None:
    if getattr(text_config(config), "use_bidirectional_attention", False):
        return ("use_bidirectional_attention=True (bidirectional text and a halved sliding window; only the causal "
                "Gemma 3 with bidirectional image blocks is proven)")
    return None


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """``Gemma3Processor`` puts ``full_image_sequence`` (``\\n\\n<boi>`` + soft tokens + ``<eoi>\\n\\n``) in place of
    every ``<boi>`` placeholder, whatever the image size (pan-and-scan crops would add more: refused)."""
    if getattr(processor.image_processor, "do_pan_and_scan", False):
        raise ValueError("Gemma 3 with do_pan_and_scan=True: the crop count is not planned; set do_pan_and_scan=False")
    return [(processor.full_image_sequence, int(processor.image_seq_length))] * len(sizes)


GEMMA3 = register_family(FamilySpec(
    name="gemma3", model_types=("gemma3", "gemma3_text"),
    proof=Proof(
        _PROOF,
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[gemma3]",
            "dpo": "tests/test_preference_dpo.py::test_dpo_step_equals_trl[gemma3-packed]",
            "reward": "tests/test_preference_reward.py::test_reward_step_equals_trl[gemma3]",
        },
    ),
    model=ModelRules(
        attention="causal_image_blocks", image_blocks=_image_blocks, layer_kinds=_LAYER_KINDS,
        extra_checks=(_causal_only,),
    ),
    encoding=EncodingRules(
        token_keys=("input_ids", "labels", "token_type_ids"),
        media_tokens=("<start_of_image>", "<image_soft_token>", "<end_of_image>"), image_text=_image_text,
        expansion_writes_text=True,  # "\n\n" before and after each image
    ),
))
