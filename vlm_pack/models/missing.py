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


_OMNI = MissingRule(
    "the full Omni model (thinker + talker) is not proven: the Omni thinker's time-aligned mRoPE is proven per "
    "sample for the thinker alone (train Qwen2_5OmniThinkerForConditionalGeneration: text, image and audio inputs; "
    "videos are not packed)",
    "positions would be 1-D instead of the model's 3-D rope: every image, video and audio token gets a wrong position",
)

MISSING_RULES: dict[str, MissingRule] = {
    "deepseek_ocr2": MissingRule(
        "DeepSeek-OCR 2's local crops (pixel_values_local, counted per image by num_local_patches) need a row rule "
        "splitting them by that count, and its SAM + query-encoder tower is not proven under packing",
        "untested: crop rows would be attributed by guess",
    ),
    "mistral_large4": MissingRule(
        "Mistral Large 4's indexed (DeepSeek Sparse) attention keeps, for each query, the top index_topk keys its "
        "indexer scores under the dense causal mask of the whole row; exact packing needs that top-k taken per "
        "sample (other samples' keys excluded first), which vlm_pack's packed attention does not implement (it "
        "builds no dense mask for the indexer)",
        "untested: the indexer would get no mask and, once a row exceeds index_topk tokens, select other samples' keys",
    ),
    "glm5_next": MissingRule(
        "GLM-5 Next combines indexed (DeepSeek Sparse) attention, whose per-query top-k over the whole row's causal "
        "mask vlm_pack does not take per sample, with forget-gated linear-attention layers and hyper-connections "
        "that vlm_pack's packed linear forwards (Gated DeltaNet, short conv, Mamba-2) do not cover",
        "untested: the indexer would select other samples' keys and the linear layers carry their state across samples",
    ),
    "voxtral": MissingRule(
        "VoxtralProcessor encodes chats through its tokenizer's own mistral-common chat encoding (no assistant mask, "
        "no jinja template), and mistral-common is not a vlm_pack dependency: there is no offline processor to derive "
        "labels from and prove the audio placement on (Qwen2-Audio is the proven audio LLM)",
        "untested: labels and audio-token placement have no proof",
    ),
    "got_ocr2": MissingRule(
        "chats cannot be encoded for GOT-OCR2: transformers' GotOcr2Processor builds its own OCR prompt and rejects "
        "what apply_chat_template hands it (each sample's images as a list: 'Nested images are only supported with "
        "multi_page'; a batch without images: 'You must provide valid images'), and vlm_pack has no encoder of its "
        "own for it (the model itself is causal Qwen2 with per-image features, which packing would need nothing new "
        "for)",
        "the collator still cannot encode a batch: the processor rejects every chat batch (measured with a tiny "
        "GotOcr2Processor, with and without multi_page)",
    ),
    "shieldgemma2": MissingRule(
        "ShieldGemma2ForImageClassification is a classifier, not a causal LM to fine-tune on chats: it returns the "
        "Yes / No logits of each row's LAST token, so a packed row holds one classification, its last sample's. Its "
        "language model is Gemma 3 (model.model, a Gemma3ForConditionalGeneration), which is registered and proven: "
        "pack and fine-tune that",
        "every sample of a packed row but the last would get no Yes / No output (the classifier reads logits[:, -1])",
    ),
    "qwen2_5_omni": _OMNI,
    "qwen3_omni_moe": _OMNI,
}
