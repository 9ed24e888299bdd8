"""Molmo 2's pooling-index guard at its bound (issue 45), apart from the family's own tests (Molmo 2's numbering is
being changed for transformers 5.25 elsewhere): ``image_token_pooling`` indexes a sample's flattened patches, so
index ``count - 1`` is the sample's last patch and index ``count`` (the sample's patch count) is outside it: the next
sample's first patch, which a packed row would not carry along. Both samples of one processor call, numbered over
the call."""

from __future__ import annotations

import pytest
import torch

from vlm_pack.data.patch_index import localize


def _patches(crops: int, per_crop: int = 4) -> torch.Tensor:
    return torch.zeros(crops, per_crop, 3)


@pytest.mark.parametrize("sample", [0, 1])
def test_pooling_index_equal_to_the_patch_count_is_refused_and_one_less_is_kept(sample):
    sources = [_patches(2), _patches(3)]  # 8 and 12 patches: sample 1's numbered from 8
    counts, offsets = [8, 12], [0, 8]
    last = [torch.tensor([[0, -1], [1, 2]]), torch.tensor([[8, 9], [-1, 10]])]
    last[sample] = last[sample].clone()
    last[sample][0, 0] = offsets[sample] + counts[sample] - 1  # the sample's last patch: kept, made local
    local = localize(last, sources, "image_token_pooling", "pixel_values")
    assert int(local[sample][0, 0]) == counts[sample] - 1
    assert int(local[1].min()) == -1 and int(local[1].max()) <= 11
    past = [t.clone() for t in last]
    past[sample][0, 0] = offsets[sample] + counts[sample]  # == the sample's patch count: outside it
    with pytest.raises(ValueError, match=rf"^sample {sample}: processor output 'image_token_pooling' indexes patches "
                                         rf"outside the sample's own {counts[sample]} 'pixel_values' patches"):
        localize(past, sources, "image_token_pooling", "pixel_values")
