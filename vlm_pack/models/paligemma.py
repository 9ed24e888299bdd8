"""PaliGemma (``paligemma``): a SigLIP tower and a Gemma language model trained as a prefix-LM: the images and the
prompt (the prefix) attend to each other both ways, the answer (the suffix) causally.

Rules (proven in tests/test_families_round3c.py against each sample alone through the stock sdpa model):

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

Refused: PaliGemma 2 (a Gemma 2 language model), by name: its attention-logit softcapping and sliding layers are not
carried by the packed attention; chats with a system turn, several turns or images outside the user turn (PaliGemma
is single-turn); context parallelism (the prefix blocks are not split across ranks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import IMAGE_BLOCKS_CONTEXT_PARALLEL_REFUSAL, FamilySpec, ImageBlockRule, register_family, text_config

PREFIX_BLOCKS = ImageBlockRule(token_key="token_type_ids", block_types=(0,), layer_types=frozenset({"full_attention"}),
                               model_class="PaliGemmaModel")


def _gemma_language_model(config: Any) -> str | None:
    text = text_config(config)
    kind = getattr(text, "model_type", None)
    if kind == "gemma2":
        return ("language model 'gemma2' (PaliGemma 2): its attention-logit softcapping (attn_logit_softcapping) and "
                "sliding-window layers are not carried by the packed attention; only PaliGemma (Gemma) is proven")
    if kind != "gemma":
        return f"language model {kind!r} (proven language model for this family: gemma)"
    return None


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
    """Forward pre-hook of ``PaliGemmaModel`` in a packed row: positions + 1 (the model counts from 1)."""
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
    name="paligemma", model_types=("paligemma",), proof="tests/test_families_round3c.py",
    min_transformers="5.24",  # proven on 5.24 only (registered in round 3, never run on the floor)
    proven={"budget": "tests/test_families_round3c.py::test_paligemma_planned_length_equals_the_real_processor"},
    attention="causal_image_blocks", image_blocks=lambda config: PREFIX_BLOCKS,
    token_keys=("input_ids", "labels", "token_type_ids"),
    context_parallel_refusal=IMAGE_BLOCKS_CONTEXT_PARALLEL_REFUSAL,
    extra_checks=(_gemma_language_model,),
    prepare_model=_prepare,
    encode_sample=encode_sample,
))
