"""PaliGemma (``paligemma``): a SigLIP tower and a Gemma language model trained as a prefix-LM: the images and the
prompt (the prefix) attend to each other both ways, the answer (the suffix) causally. PaliGemma 2 is the same
``model_type`` with a Gemma 2 language model.

Rules (proven in tests/test_family_paligemma.py against each sample alone through the stock sdpa model):

* attention inside a sample is ``causal OR both in the prefix``, never across samples: the prefix is the run of
  ``token_type_ids == 0`` that PaliGemmaProcessor writes for ``<image>``s + BOS + prompt + ``"\\n"`` (the suffix,
  answer + EOS, is typed 1), exactly the block ``PaliGemmaModel`` builds for its own mask
  (``block_sequence_ids = where(token_type_ids == 0, 0, -1)``). In a packed row each sample's prefix is its own
  block (the image-block rule with ``block_types=(0,)``: a prefix run ends at its sample's suffix, and blocks never
  reach past a sample's boundary); ``enable_packing`` reads ``token_type_ids`` from the ``PaliGemmaModel`` forward;
* ``PaliGemmaConfig`` makes the text layers non-causal (``use_bidirectional_attention=True``) and leaves causality to
  that mask, which a packed row does not build: the family setup makes the language model's attention layers causal
  again (the stock paths always pass a full mask, so they are unchanged);
* positions are 1-indexed (``PaliGemmaModel``'s default ``position_ids`` are ``arange + 1``): the collator's
  positions restart at 0 per sample, and the family setup adds 1 in a packed row;
* encoding: the processor has no chat template and fails on ragged batches, so each sample is encoded ALONE by the
  processor's own prompt / suffix rule (``encode_sample``): a sample is one user turn (its images and prompt text)
  and one assistant answer; labels are the processor's own (the suffix tokens).

PaliGemma 2 (Gemma 2 text; proven in tests/test_family_paligemma.py against each sample alone through the stock
EAGER model, the only one transformers builds for Gemma 2: its sdpa path has no softcapping and is refused):

* attention-logit softcapping (``attn_logit_softcapping``) reaches the packed attention as ``softcap``, which every
  backend ``"auto"`` routes to applies (``vlm_pack.attention.varlen``); ``query_pre_attn_scalar`` reaches it as
  ``scaling``; the final logit softcapping is the chunked loss's (``LOGIT_TRANSFORMS``);
* sliding layers keep their window inside each sample, counted from its start; the prefix block holds in the
  sliding layers too (``PaliGemmaModel`` ORs it into both masks). transformers' sliding mask is
  ``(window AND causal) OR prefix`` while the packed attention's is ``(causal OR prefix) AND window``: the two agree
  while a prefix fits in the window, so a longer prefix is refused by name (``_check_prefix_fits``).

Refused: chats with a system turn, several turns or images outside the user turn (PaliGemma is single-turn);
context parallelism (the prefix blocks are not split across ranks); a Gemma 2 prefix longer than its sliding window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .registry import register_family, text_config
from .spec import EncodingRules, FamilySpec, ImageBlockRule, ModelRules, Proof

LAYER_KINDS = frozenset({"full_attention", "sliding_attention"})  # Gemma: full only; Gemma 2: alternating
PREFIX_BLOCKS = ImageBlockRule(token_key="token_type_ids", block_types=(0,), layer_types=LAYER_KINDS,
                               model_class="PaliGemmaModel")


def _gemma_language_model(config: Any) -> str | None:
    kind = getattr(text_config(config), "model_type", None)
    if kind not in ("gemma", "gemma2"):
        return f"language model {kind!r} (proven language models for this family: gemma, gemma2)"
    return None


def _check_prefix_fits(config: Any, token_types: torch.Tensor) -> None:
    """A Gemma 2 prefix must fit in the sliding window (module docstring; one host read per forward)."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if window is None or "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return
    ids = PREFIX_BLOCKS.block_ids(token_types)  # [B, T], counted per row: made unique across rows
    ids = torch.where(ids >= 0, ids + ids.shape[-1] * torch.arange(ids.shape[0], device=ids.device)[:, None], -1)
    longest = int(torch.bincount(ids[ids >= 0], minlength=1).max())
    if longest > window:
        raise ValueError(
            f"a PaliGemma 2 prefix (images + prompt) of {longest} tokens > sliding_window={window}: transformers' "
            "sliding mask lets a prefix token see its whole prefix past the window ((window AND causal) OR prefix), "
            "which the packed attention does not express; use fewer / smaller images or a shorter prompt"
        )


def _text(parts: list[dict], what: str, where: str) -> str:
    if any(part["type"] != "text" for part in parts):
        raise ValueError(f"{where}: PaliGemma takes images in the user turn only; the {what} holds "
                         f"{sorted({p['type'] for p in parts} - {'text'})}")
    return "".join(part["text"] for part in parts)


def encode_sample(processor: Any, turns: list[dict], index: int) -> dict[str, torch.Tensor]:
    """One sample by ``PaliGemmaProcessor``'s own rule: prompt = the user turn's text after its images (the
    processor writes ``<image>``s + BOS + prompt + ``"\\n"``), suffix = the assistant answer (+ EOS); the
    processor's ``input_ids``, ``token_type_ids`` (0 prefix, 1 suffix), ``labels`` (the suffix) and
    ``pixel_values``."""
    where = f"sample {index}"
    roles = [turn["role"] for turn in turns]
    if roles != ["user", "assistant"]:
        raise ValueError(f"{where}: PaliGemma is a single-turn prefix-LM: a sample is one user turn (images + prompt) "
                         f"and one assistant answer; got the roles {roles}")
    user = turns[0]["content"]
    images = [part["image"] for part in user if part["type"] == "image"]
    if not images:
        raise ValueError(f"{where}: PaliGemma needs at least one image per sample (its processor refuses none)")
    if any(part["type"] == "image" for part in user[len(images):]):
        raise ValueError(f"{where}: PaliGemma writes every image before the prompt: put the sample's images first in "
                         "its user turn")
    prompt = _text(user[len(images):], "user turn", where)
    answer = _text(turns[1]["content"], "assistant turn", where)
    out = processor(images=[images], text=[processor.image_token * len(images) + prompt], suffix=[answer])
    out = {key: torch.as_tensor(np.asarray(out[key])) for key in ("input_ids", "token_type_ids", "labels",
                                                                   "pixel_values")}
    if not (out["token_type_ids"] == 1).any():
        raise ValueError(f"{where}: the processor's tokenizer typed no suffix token (token_type_ids all 0), so the "
                         "answer cannot be told from the prompt; use a tokenizer that types pair sequences")
    return out


def _one_indexed_positions(module, args, kwargs):
    """Forward pre-hook of ``PaliGemmaModel``: a Gemma 2 prefix fits its window; in a packed row, positions + 1 (the
    model counts from 1)."""
    if kwargs.get("token_type_ids") is not None:
        _check_prefix_fits(module.config, kwargs["token_type_ids"])
    positions = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is None or positions is None:
        return None
    return args, {**kwargs, "position_ids": positions + 1}


def _prepare(model: torch.nn.Module) -> None:
    """Causal text attention (the prefix blocks come from the image-block rule) and 1-indexed packed positions."""
    from transformers import PaliGemmaModel

    for module in model.modules():
        if isinstance(module, PaliGemmaModel) and getattr(module, "_vlm_pack_positions", None) is None:
            module._vlm_pack_positions = module.register_forward_pre_hook(_one_indexed_positions, with_kwargs=True)
            for layer in module.language_model.modules():
                if hasattr(layer, "is_causal") and hasattr(layer, "q_proj"):
                    layer.is_causal = True


PALIGEMMA = register_family(FamilySpec(
    name="paligemma", model_types=("paligemma",),
    proof=Proof(
        "tests/test_family_paligemma.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_paligemma.py::test_paligemma_planned_length_equals_the_real_processor"},
    ),
    model=ModelRules(
        attention="causal_image_blocks", image_blocks=lambda config: PREFIX_BLOCKS, layer_kinds=LAYER_KINDS,
        extra_checks=(_gemma_language_model,), prepare_model=_prepare,
    ),
    encoding=EncodingRules(token_keys=("input_ids", "labels", "token_type_ids"), encode_sample=encode_sample),
))
