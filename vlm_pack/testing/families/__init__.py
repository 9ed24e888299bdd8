"""One module per family (or family line: versions sharing a processor live together): its offline processor and
tiny model builders in a ``BUILDERS`` dict, registered in ``vlm_pack.testing.tiny_families``. Shared helpers:
``vlm_pack.testing.family_parts``.
"""
