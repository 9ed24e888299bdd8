"""LFM2-VL and its LFM2 text model (short convolutions + attention) exact under packing.

Same proof as the harness of tests/test_vlm_families.py: a packed micro-batch through ``enable_packing`` +
``VLMPackingCollator`` equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32
CPU): logits and per-sample losses within the measured fp32 noise floor, gradients within ``GRAD_REL_L2``
(tests/tolerance.py); the edge batch (system prompts, a one-word answer, an image inside an assistant turn,
text-only and multi-image samples of different sizes); one corruption per family rule that must break the
comparison; unproven variants refused by name.

Tiny models and offline processors: ``vlm_pack/testing/families/lfm2_vl.py`` (via ``vlm_pack.testing.tiny_families``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["lfm2_vl"])
def test_edge_batch_equals_each_sample_alone(family):
    families.test_edge_batch_equals_each_sample_alone(family)


@pytest.mark.parametrize("family", ["lfm2_vl"])
def test_corruptions_are_caught(family):
    """Vision rows swapped between two same-size images; positions not restarted per sample (see the harness)."""
    families.test_corruptions_are_caught(family)


@pytest.mark.parametrize("family", ["lfm2_vl"])
def test_collator_stats_count_every_familys_images(family):
    families.test_collator_stats_count_every_familys_images(family)


@torch.no_grad()
def test_corruption_lfm2_conv_window_carried_across_samples(monkeypatch):
    """LFM2's short-convolution layers must restart their window per sample: enable_packing installs the
    boundary-aware forward on its Lfm2ShortConv modules, and the window carried over the whole row (boundaries
    ignored) is caught. The edge batch holds tiled images (crops + thumbnail) too: their rows follow their sample."""
    from vlm_pack.attention import linear as la

    setup = families.setup_for("lfm2_vl")
    convs = [m for m in setup.packed.modules() if type(m).__name__ == "Lfm2ShortConv"]
    assert convs and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in convs)
    examples = families.edge_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    assert batch["pixel_values"].shape[0] > 5  # more tiles than the edge batch's 5 images
    refs[3].logits.check(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))
    exact, total = la.segmented_causal_conv1d, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(hidden_states, weight, bias, activation, layout):
        return exact(hidden_states, weight, bias, activation, whole_row)

    monkeypatch.setattr(la, "segmented_causal_conv1d", carried)
    assert refs[3].logits.is_far(families.logit_error(batch, families.packed_logits(setup.packed, batch), refs))


def test_lfm2_text_model_packed_equals_each_sample_alone():
    """LFM2 on its own (Lfm2ForCausalLM, the language model of LFM2-VL): short-convolution (window 3) and attention
    layers, text chats packed with the tokenizer's collator against each sample alone through the stock model
    (logits, losses, the model's own loss, gradients)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.integrations.hf_model import enable_packing
    from vlm_pack.testing.data import text_chat_examples
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()

    def model():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = Lfm2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                                conv_L_cache=3, block_auto_adjust_ff_dim=False, initializer_range=0.2)
            return Lfm2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()

    packed = enable_packing(model())
    collator = VLMPackingCollator(tokenizer, max_length=1024, model_config=packed.config)
    assert collator.family.name == "lfm2_vl"
    setup = families.Setup("lfm2", tokenizer, model(), packed, collator)
    result = families.compare(setup, text_chat_examples(3, seed=1, max_turns=2))
    print("lfm2", result)
    families.assert_exact(result)
