"""Aria (Idefics3-style vision tower + cross-attention projector + a mixture-of-experts text model): features
placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_family_aria.py): ``pixel_values`` / ``pixel_mask`` have one row per image (each
image resized and padded to ``max_image_size``); the vision tower runs per image on its own patch mask and the
projector's learned queries cross-attend to that image's patches only (``get_image_features`` gets no text
kwargs), so each image becomes the same number of ``<|img|>`` features, filled in sample order. The router picks
experts per token. ``split_image=True`` (crops per image) is not proven: its processor gives every image of a call
the call's largest crop count, and the collator refuses such batches (one row per image is declared, so crop rows
never match).
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Proof, VisionRows

ARIA = register_family(FamilySpec(
    name="aria", model_types=("aria",),
    proof=Proof(
        "tests/test_family_aria.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={
            "budget": "tests/test_budget_packs.py::test_planned_length_equals_the_real_processor_for_every_family[aria]",
            "context_parallel": "tests/test_family_aria.py::test_edge_batch_equals_each_sample_alone[aria]",
        },
    ),
    encoding=EncodingRules(vision=VisionRows(rows={"pixel_values": "image", "pixel_mask": "image"})),
))
