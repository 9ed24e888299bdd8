"""Data layer: from chat examples to the packed batch a model consumes.

``chat`` normalises examples (messages, images, videos) and renders them with the processor's template,
``chat_template`` locates assistant turns for the loss mask, ``patch_index`` keeps patch indices per sample (Molmo 2's pooling), ``collator`` turns a micro-batch into one packed row
(or the padded A/B batch) with per-sample positions and vision tensors in sample order.

Imports: ``vlm_pack.core``, ``vlm_pack.attention`` and ``vlm_pack.models`` (the family registry tells the
collator each family's position rule and processor keys). Never the integrations, paths or CLI above it.
"""
