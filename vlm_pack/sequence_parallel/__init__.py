"""Sequence parallelism for packed rows: DeepSpeed Ulysses (ALST) through ``transformers.Trainer``.

A packed row longer than one GPU holds is split across ``sp`` ranks: the vision tower and the embedding merge run
on the whole row (replicated), each rank's language model runs on its slice of the row, and DeepSpeed's
``UlyssesSPAttentionHF`` all-to-alls the heads so that each rank's attention sees the whole row for its heads,
with the row's packed boundaries (``cu_seq_lens_*``) passed as they are. See docs/sequence_parallelism.md.

* :mod:`.batch` - any vlm_pack batch -> the batch ``UlyssesSPDataLoaderAdapter`` can slice (:class:`UlyssesCollator`);
* :mod:`.model` - :func:`prepare_model`: attention names, the whole-row / slice hooks, what is refused;
* :mod:`.trainer` - :class:`UlyssesTrainer`: the global token mean over the step, setup checks;
* :mod:`.setup` - :func:`ulysses_setup`: model + collator + ``ParallelismConfig`` in one call.

Imports: ``core``, ``attention``, ``models``, ``data`` and ``integrations`` (a path, floor 6 of
tests/test_layers.py); DeepSpeed and accelerate where used. Nothing below imports it.
"""

from ..lazy_exports import lazy_getattr

_LAZY = {
    "SP_ATTN_IMPLEMENTATION": "model",
    "UlyssesCollator": "batch",
    "UlyssesSetup": "setup",
    "UlyssesTrainer": "trainer",
    "grouped_rows": "batch",
    "prepare_model": "model",
    "ulysses_batch": "batch",
    "ulysses_setup": "setup",
    "zero3_config": "setup",
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
