"""Granite 4 Vision: LLaVA-NeXT anyres crops through a CLIP tower, a window Q-Former projector per crop, and deepstack
features added to the image tokens of chosen decoder layers; Granite text (embedding / attention / residual
multipliers, logit scaling: all per token). 1-D positions per sample.

Rules (proven in tests/test_family_granite.py against each sample alone through the stock sdpa model): the
vision tower, Q-Former windows and spatial sampling run per crop of one image, never see the text; every deepstack
layer scatters each image's features onto its own ``<image>`` tokens in sample order (``masked_scatter`` by
image-token id), so a packed row gets the same per-token additions as each sample alone. ``pixel_values`` has one
row per image (its crops padded to the batch's largest count) and ``image_sizes`` one row per image, as LLaVA-NeXT.
The text model is causal over the packed row split at ``cu_seq_lens_q``.
"""

from .registry import register_family
from .spec import EncodingRules, FamilySpec, Proof, VisionRows

GRANITE4_VISION = register_family(FamilySpec(
    name="granite4_vision", model_types=("granite4_vision",),
    proof=Proof(
        "tests/test_family_granite.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_granite.py::test_planned_length_equals_the_real_processor[granite4_vision]"},
    ),
    encoding=EncodingRules(vision=VisionRows(rows={"pixel_values": "image", "image_sizes": "image"})),
))
