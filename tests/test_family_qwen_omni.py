"""Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (images, audio; video refused) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/qwen_omni.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_corruption_one_dimensional_positions(family):
    """The family's position rule is mRoPE from its own get_rope_index per sample: a 1-D arange is caught."""
    families.test_corruption_one_dimensional_positions(family)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_omni_video_is_refused(family):
    """The Omni thinkers' videos' positions interleave with the audio track in time: a video is refused when the
    batch is built, naming what to do (audio parts are packed: tests/test_audio_packing.py)."""
    import numpy as np

    collator = families.setup_for(family).collator
    chat = [{"role": "assistant", "content": "A beep."}]
    video = {"messages": [{"role": "user", "content": [{"type": "video", "video": np.zeros((2, 28, 28, 3), np.uint8)}]},
                          *chat]}
    with pytest.raises(ValueError, match=f"a video with a {family} model: video inputs .* is not proven for this family"):
        collator([video])
