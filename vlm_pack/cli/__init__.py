"""CLI layer: the ``vlm-pack`` command (``main``), its ``demo``, ``stats`` and ``doctor`` subcommands.

The top floor: it may import every layer below (core, attention, models, data, integrations and the paths
``offline``, ``budget``, ``preference``); nothing in the library imports it. ``--help`` and the offline
subcommands stay free of torch until a subcommand needs it. The demo alone uses ``vlm_pack.testing`` (it is a
user of the library, training tiny stand-in models on shipped data).
"""
