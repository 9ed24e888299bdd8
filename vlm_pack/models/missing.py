"""What packing would need, and get wrong without, for model types vlm_pack knows but has not proven.

``get_family`` names these in its refusal ("prefix-LM attention over packed rows is not implemented"), so a user
learns which rule is missing and what ``allow_unproven=True`` (causal attention, 1-D positions restarting per
sample) would get wrong, instead of only "not registered". The errors quoted were measured when issue 22 was filed
(tiny models built from config objects, transformers 5.24, packed with ``allow_unproven=True`` against each sample
alone).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MISSING_RULES", "MissingRule"]


@dataclass(frozen=True)
class MissingRule:
    """``rule``: what exact packing of the family needs that vlm_pack does not implement; ``unproven``: what the
    plain causal 1-D-position packing of ``allow_unproven=True`` gets wrong for it."""

    rule: str
    unproven: str


_PALIGEMMA = MissingRule(
    "chats cannot be encoded for PaliGemma: transformers' PaliGemmaProcessor writes its BOS after the last <image> "
    "of the rendered chat (and a newline at its end), so the assistant-token mask, computed on the text before "
    "that insertion, lands len(bos_token) characters early on every assistant turn after the last image "
    "(labelling the end of the assistant header); it fails on a batch of samples of different lengths (labels "
    "built with numpy from ragged input_ids), refuses a sample without images, and marks every chat token as prefix "
    "(token_type_ids all 0, so the stock model would let the answer attend both ways). vlm_pack has no encoder of "
    "its own for it. The prefix-LM attention itself would fit the image-block rule (one block per sample: its "
    "token_type_ids == 0 prefix, read by PaliGemmaModel) with the text layers made causal again (PaliGemmaConfig "
    "sets use_bidirectional_attention=True and leaves causality to a mask that packing drops); PaliGemma 2's "
    "Gemma 2 language model adds attention-logit softcapping, which the packed attention refuses",
    "the collator fails on any batch of two samples of different lengths and labels a sample alone on its "
    "assistant header (measured with a tiny PaliGemmaProcessor); the model's text layers, non-causal by config, "
    "attend both ways over each whole sample, answers included (max |dlogit| 9.5 measured on a tiny PaliGemma "
    "with the processor's own prefix/suffix encoding)",
)
_OMNI = MissingRule(
    "the Omni thinker's time-aligned mRoPE (audio and video positions interleaved in time) is not computed per "
    "sample, and audio inputs are not packed",
    "positions would be 1-D instead of the model's 3-D rope: every image, video and audio token gets a wrong position",
)

MISSING_RULES: dict[str, MissingRule] = {
    "got_ocr2": MissingRule(
        "chats cannot be encoded for GOT-OCR2: transformers' GotOcr2Processor builds its own OCR prompt and rejects "
        "what apply_chat_template hands it (each sample's images as a list: 'Nested images are only supported with "
        "multi_page'; a batch without images: 'You must provide valid images'), and vlm_pack has no encoder of its "
        "own for it (the model itself is causal Qwen2 with per-image features, which packing would need nothing new "
        "for)",
        "the collator still cannot encode a batch: the processor rejects every chat batch (measured with a tiny "
        "GotOcr2Processor, with and without multi_page)",
    ),
    "paligemma": _PALIGEMMA,
    "shieldgemma2": MissingRule(
        "ShieldGemma2ForImageClassification is a classifier, not a causal LM to fine-tune on chats: it returns the "
        "Yes / No logits of each row's LAST token, so a packed row holds one classification, its last sample's. Its "
        "language model is Gemma 3 (model.model, a Gemma3ForConditionalGeneration), which is registered and proven: "
        "pack and fine-tune that",
        "every sample of a packed row but the last would get no Yes / No output (the classifier reads logits[:, -1])",
    ),
    "qwen2_5_omni": _OMNI,
    "qwen2_5_omni_thinker": _OMNI,
    "qwen3_omni_moe": _OMNI,
    "qwen3_omni_moe_thinker": _OMNI,
    "fast_vlm": MissingRule(
        "the vision tower must not mix images, and FastVLM's (timm FastViT-MCi, every ConvMlp a BatchNorm2d that "
        "inference_mode does not fold) normalises by the statistics of every image in the forward while training; "
        "vlm_pack has no rule keeping such a tower in eval mode or running it per sample",
        "in training mode each image's features depend on the other samples' images of the packed row (not "
        "measured here: the timm tower needs the PyPI package timm, which the test environment lacks)",
    ),
    "perception_lm": MissingRule(
        "PerceptionLM's pixel_values hold one stack of tiles per image (thumbnail + up to max_num_tiles crops, a "
        "count that depends on the aspect ratio) and the model flattens images x tiles; vlm_pack has no rule "
        "joining stacks of different lengths into one packed tensor (the processor itself cannot stack them)",
        "collation fails (measured: the processor's 'stack expects each tensor to be equal size') as soon as two "
        "images of a micro-batch have different tile counts; the timm Perception Encoder tower was not built here "
        "(the PyPI package timm is missing)",
    ),
}
