"""``PackedSFTTrainer``: TRL's ``SFTTrainer`` with the two settings packed batches need, nothing else changed.

* ``num_tokens``: TRL counts a padding-free batch as ``position_ids.size(1)`` tokens, right for a ``[1, T]`` row but
  1 for the mRoPE positions ``[C, 1, T]`` of Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 packed rows; this class counts
  the row's ``T`` slots instead (the real tokens when no alignment padding is asked for, as TRL's
  ``attention_mask.sum()`` counts for the same samples padded). ``mean_token_accuracy`` needs no change: TRL scores
  the labels of the row, and each sample's first label is -100, so no prediction across a boundary is counted.
* ``dispatch_batches`` off: accelerate's default for an ``IterableDataset`` slices every tensor of a batch along
  dim 0, which no packed batch survives (see :func:`vlm_pack.integrations.hf_model.packed_forward_hook`); each process then reads and
  packs its own samples. An explicit ``dispatch_batches=True`` is refused.
* streaming packs: a ``train_dataset`` with a ``trainer_callback()`` (``vlm_pack.streaming.StreamingPackDataset``,
  which TRL's own type check would refuse) is trained on as is: TRL is set up on a one-row stand-in, the packs are
  served by the dataset's ``collate_fn``, its callback is added, ``ignore_data_skip`` set (the callback restores
  the stream position on resume) and ``remove_unused_columns`` unset (packs are model-ready).
* TRL's fused LM head runs in smaller tiles (:mod:`vlm_pack.integrations.fused_tiles`): a long row's step holds a
  small fraction of its logits instead of about twice them.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import SFTTrainer

from .fused_tiles import FusedTiles
from .hf_model import keep_batches_whole, refuse_dispatch

__all__ = ["PackedSFTTrainer"]


def _stand_in(with_images: bool):
    """A one-row chat stream for TRL's set-up checks (never trained on)."""
    import datasets

    row = {"messages": [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]}
    if with_images:
        row["images"] = []
    return datasets.IterableDataset.from_generator(lambda: iter([row]))


class PackedSFTTrainer(FusedTiles, SFTTrainer):
    """``SFTTrainer`` for packed batches (``VLMPackingCollator``, offline packs): same arguments, same training."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse_dispatch(config, "PackedSFTTrainer")
        stream = kwargs.get("train_dataset")
        make_callback = getattr(stream, "trainer_callback", None)
        if make_callback is not None:
            kwargs["train_dataset"] = _stand_in(stream.collator.has_images)
            kwargs["data_collator"] = stream.collate_fn
        super().__init__(*args, **kwargs)
        keep_batches_whole(self)
        if make_callback is not None:
            self.train_dataset = stream
            self.args.ignore_data_skip = True
            self.args.remove_unused_columns = False  # packs are model-ready; Trainer must not strip their keys
            callback = make_callback()
            callback.on_init_end(self.args, self.state, self.control)  # the other settings a stream needs
            self.add_callback(callback)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        counted = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        positions = inputs.get("position_ids")
        if self.model.training and "attention_mask" not in inputs and positions is not None and positions.dim() == 3:
            slots = torch.tensor(positions.size(-1), device=positions.device)
            self._total_train_tokens = counted + self.accelerator.gather_for_metrics(slots).sum().item() // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result
