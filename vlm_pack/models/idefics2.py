"""Idefics2: a perceiver resampler per image, features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): ``pixel_values`` ``[B, max_images, C, H, W]`` and
``pixel_attention_mask`` have one row PER SAMPLE (text-only samples included), images padded to the batch's
largest and all-zero image slots dropped by the model; the vision tower runs per image with its own patch mask,
the perceiver resamples each image to ``resampler_n_latents`` latents (attending to that image's real patches
only), and ``masked_scatter`` fills the ``<image>`` tokens in sample order. None of them receives the text
kwargs. The language model is a proven text family (Mistral, sliding window inside each sample).

Labels: ``Idefics2Processor`` reports the assistant mask of the chat before its expansion (``<image>`` ->
``<fake_token_around_image>`` + ``image_seq_len`` ``<image>`` + ``<fake_token_around_image>``, adjacent markers
merged, a space put before text that follows an image), so the mask is carried through the expansion
(``mask_before_expansion``); token-budget plans use the processor's own text expansion, which needs no pixels.
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows


def _expand_text(processor: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered chats as ``apply_chat_template`` gets them: the processor expands the placeholders
    (text only) and adds the tokenizer's special tokens unless the chat starts with its BOS (transformers' rule)."""
    bos = processor.tokenizer.bos_token
    special = not (bos is not None and texts[0].startswith(bos))
    return processor(text=texts, add_special_tokens=special)["input_ids"]


IDEFICS2 = register_family(FamilySpec(
    name="idefics2", model_types=("idefics2",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[idefics2]",
            "context_parallel": "tests/test_vlm_families.py::test_edge_batch_equals_each_sample_alone[idefics2]",
        },
    ),
    model=ModelRules(extra_checks=(text_backbone("mistral", "llama", "qwen2", "qwen3"),)),
    encoding=EncodingRules(
        media_tokens=("<fake_token_around_image>",), mask_before_expansion=True, expand_text=_expand_text,
        vision=VisionRows(rows={"pixel_values": "sample", "pixel_attention_mask": "sample"}),
    ),
))
