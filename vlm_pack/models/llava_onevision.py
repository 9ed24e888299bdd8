"""LLaVA-OneVision: anyres crops per image, features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): the vision tower (SigLIP) and projector run per crop, never see
the text kwargs (``get_image_features`` is called without them) and each image's features land on its own
``<image>`` tokens (``masked_scatter`` in sample order). The text model is a proven text family (Qwen2), causal
over the packed row split at ``cu_seq_lens_q``, positions restarting per sample. ``batch_num_images`` is per
sample: a sample with ONE image is cropped anyres, a sample with several is not, so the collator must keep
one count per sample holding images (never one count for the whole packed row).
"""

from typing import Any

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows


def _image_text(processor: Any, sizes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """A sample's only image: the processor's anyres count (``_get_num_multimodal_tokens``); each image of a
    multi-image sample: the base grid plus one newline token (``LlavaOnevisionProcessor.replace_image_token``),
    minus the CLS token under the ``default`` feature strategy."""
    if len(sizes) == 1:
        counts = processor._get_num_multimodal_tokens(image_sizes=[list(sizes[0])])["num_image_tokens"]
    else:
        counts = [processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")] * len(sizes)
    return [(processor.image_token * int(n), int(n)) for n in counts]


# No reference to prove packed rollouts against (measured with TRL 1.16 on the tiny model).
_NO_TRL_ROLLOUTS = ("TRL 1.16's own GRPOTrainer / RLOOTrainer cannot run LLaVA-OneVision (their log-prob method "
                    "rejects the processor's batch_num_images), so packed rollouts have no reference to equal")
# Measured with TRL 1.16's DPOTrainer (which serves it) and allow_unproven=True: a collation crash, no step.
_NO_PACKED_PAIRS = ("PreferenceCollator encodes each pair on its own, and the processor pads pixel_values to the "
                    "most crops of each call, so pairs with images of different sizes cannot be concatenated "
                    "(RuntimeError in torch.cat); use TRL's DPOTrainer")

LLAVA_ONEVISION = register_family(FamilySpec(
    name="llava_onevision", model_types=("llava_onevision",),
    proof=Proof(
        "tests/test_vlm_families.py",
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[llava_onevision]",
            "sequence_parallel": "tests/test_multiprocess.py::test_ulysses_sequence_parallel_equals_each_sample_alone[sp_llava_onevision]",
            "context_parallel": "tests/test_vlm_families.py::test_context_parallel_alignment_equals_each_sample_alone[llava_onevision]",
        },
        refused={**dict.fromkeys(("rl", "rl_shared_prompt"), _NO_TRL_ROLLOUTS),
                 **dict.fromkeys(("dpo", "dpo_shared_prompt"), _NO_PACKED_PAIRS)},
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2", "llama", "qwen3"),)),
    encoding=EncodingRules(
        image_text=_image_text,
        vision=VisionRows(
            rows={"pixel_values": "image", "image_sizes": "image", "batch_num_images": "sample_with_images"},
        ),
    ),
))
