"""Patch indices per sample: processor outputs whose values number the patches of another output
(``VisionRows.patch_indices``; Molmo 2's ``image_token_pooling`` into ``pixel_values``).

Processors number them one of two ways, found by :func:`numbering` from what the image processor returns for two
identical images (not from its release):

* ``"call"``: over the flattened patches (dims 0 and 1 of the patch tensor) of the WHOLE call (Molmo 2 on
  transformers <= 5.24), so a sample's share points at patches whose numbers depend on the samples encoded before
  it. :func:`localize` makes each sample's indices its own, counted from its first patch; :func:`join`
  concatenates samples, re-basing each by the patches of the samples before it;
* ``"image"``: each image's patches from 0, the model adding each image's offset itself (Molmo 2 on 5.25, from
  ``image_num_crops``). The indices then follow their sample unchanged; :func:`localize` checks that each points
  inside its own sample once the image's offset in the sample (``VisionRows.patch_image_offsets``) is added.

Either way a packed (or padded) batch reads exactly the patches each sample reads alone. ``-1`` (no patch) stays
``-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

__all__ = ["Numbering", "join", "localize", "numbering"]

Numbering = Literal["call", "image"]


def numbering(image_processor: Any, key: str, source_key: str) -> Numbering:
    """How ``image_processor`` numbers ``key``'s patches of ``source_key``: from what it returns for two identical
    blank images (the second image's indices equal the first's: ``"image"``; shifted by its patches: ``"call"``)."""
    from PIL import Image

    blank = Image.new("RGB", (28, 28))
    out = image_processor(images=[blank, blank], return_tensors="pt")
    indices, patches = out[key], out[source_key]
    first, second = indices[:indices.shape[0] // 2], indices[indices.shape[0] // 2:]
    shift = patches.shape[0] // 2 * patches.shape[1]
    if torch.equal(first, second):
        return "image"
    if torch.equal(torch.where(first >= 0, first + shift, first), second):
        return "call"
    raise ValueError(f"{type(image_processor).__name__} numbers {key!r} neither per call nor per image (two identical "
                     "images: neither equal nor shifted by the first's patches); vlm_pack cannot pack it")


def _patches(source: torch.Tensor | None) -> int:
    """Flattened patches (dims 0 and 1) of one sample's share of the patch tensor."""
    return 0 if source is None else source.shape[0] * source.shape[1]


def localize(indices: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor | None], key: str,
             source_key: str, image_offsets: Sequence[torch.Tensor | None] | None = None,
             ) -> list[torch.Tensor | None]:
    """Each sample's ``indices`` counted from its own first patch of ``sources``; an index outside the sample's own
    patches is an error naming the sample. ``image_offsets`` None: numbered over the whole call (samples in order),
    re-counted here; else numbered per image: each sample's per-row offsets of the row's image in the sample (the
    indices stay as they are, the model adds the offsets)."""
    out, offset = [], 0
    for index, (values, source) in enumerate(zip(indices, sources)):
        count = _patches(source)
        if values is not None:
            if image_offsets is None:
                local = torch.where(values >= 0, values - offset, values)
                read = local
            else:
                local, read = values, torch.where(values >= 0, values + image_offsets[index][:, None], values)
            if ((values >= 0) & ((read < 0) | (read >= count))).any():
                raise ValueError(
                    f"sample {index}: processor output {key!r} indexes patches outside the sample's own {count} "
                    f"{source_key!r} patches, so they cannot follow it into a packed row (processor and model family "
                    "do not match)"
                )
            out.append(local)
        else:
            out.append(None)
        offset += count
    return out


def join(indices: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor | None],
         by: Numbering = "call") -> torch.Tensor:
    """The samples' own ``indices`` (:func:`localize`) concatenated in sample order; numbered ``by`` call: each
    re-based by the patches of ``sources`` of the samples before it (per image: unchanged)."""
    parts, offset = [], 0
    for values, source in zip(indices, sources):
        if values is not None:
            parts.append(torch.where(values >= 0, values + offset, values) if by == "call" else values)
        offset += _patches(source)
    return torch.cat(parts)


def image_offsets_of(split: Mapping[str, Sequence[torch.Tensor | None]], samples: int,
                     offsets: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]) -> list[torch.Tensor | None]:
    """Per sample, ``offsets`` of its vision share (``split``: key -> per-sample shares); None without one."""
    shares = [{key: chunks[index] for key, chunks in split.items() if chunks[index] is not None}
              for index in range(samples)]
    return [offsets(share) if share else None for share in shares]
