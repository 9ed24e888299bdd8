"""PerceptionLM (``perception_lm``): a timm Perception Encoder tower run on tiles (each image a thumbnail plus up to
``max_num_tiles`` crops, the count set by its aspect ratio), a projector (optionally pooled) and a causal Llama
language model. 1-D positions per sample.

Rules (proven in tests/test_family_perception_lm.py against each sample alone through the stock sdpa model):

* the processor returns one stack of tiles per image, stacks of different lengths, which it cannot batch; the
  collator asks for them unstacked and flattens them to one ``pixel_values`` row per tile (``[tiles, 1, C, H, W]``:
  the model flattens images x tiles itself, so the tower sees the same tiles in the same order), rows attributed to
  samples in proportion to their image tokens (every tile is ``(tile / patch / pooling)^2`` tokens);
* the tower runs per tile, the projector per token, and features fill the image tokens in sample order; the text
  (Llama, the registered text family) is causal with positions restarting per sample.

Refused: videos (not proven; the collator refuses video samples).
"""

from __future__ import annotations

from .registry import register_family, text_backbone
from .spec import EncodingRules, FamilySpec, ModelRules, Proof, VisionRows

PERCEPTION_LM = register_family(FamilySpec(
    name="perception_lm", model_types=("perception_lm",),
    proof=Proof(
        "tests/test_family_perception_lm.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_perception_lm.py::test_planned_length_equals_the_real_processor[perception_lm]"},
    ),
    model=ModelRules(extra_checks=(text_backbone("llama"),)),
    encoding=EncodingRules(vision=VisionRows(tile_stacks=("pixel_values",), rows={"pixel_values": "image_token"})),
))
