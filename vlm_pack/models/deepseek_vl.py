"""DeepSeek-VL: one SigLIP image per placeholder run, features placed by image-token id, 1-D positions per sample.

Rules (proven in tests/test_vlm_families.py): the vision tower and aligner run per image (``get_image_features`` is
called without the text kwargs), every image becomes the same ``num_image_tokens`` ``<image_placeholder>`` tokens
(the processor pads each image to a square of the tower's size), and ``masked_scatter`` fills them in sample order.
``pixel_values`` has one row per image. The language model is a proven text family (Llama in the checkpoints),
causal over the packed row split at ``cu_seq_lens_q``, positions restarting per sample.
"""

from . import FamilySpec, register_family, text_backbone

DEEPSEEK_VL = register_family(FamilySpec(
    name="deepseek_vl", model_types=("deepseek_vl",), proof="tests/test_vlm_families.py",
    vision_rows={"pixel_values": "image"}, extra_checks=(text_backbone("llama", "qwen2", "qwen3"),),
))
