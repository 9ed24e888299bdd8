"""Packed DPO equals TRL's own unpacked ``DPOTrainer``: one optimizer step, gradient accumulation 2, 2 pairs per
micro-batch, images of different sizes, for every family the packed DPO path is proven on: the text families (Llama,
Qwen2, Qwen3, Mistral) and the VLMs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4V, GLM-4.5V (MoE),
InternVL, Idefics3, LLaVA, Gemma 3), each in both layouts (packed; each prompt once) where the family allows it.

The reference is always TRL's trainer (``DPOTrainer`` with its own collator on the stock sdpa model); ours is
``PackedDPOTrainer`` + ``PreferenceCollator`` on the same data and weights (policy seed 0, reference seed 1, so
rewards are not 0). Per-pair log-probs are checked against TRL's ``compute_ref_log_probs`` too (a boundary bug can
cancel in the loss), and each packing rule has a corruption test that must break that equality.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import datasets
import pytest
import torch
from transformers import MistralForCausalLM
from trl import DPOConfig, DPOTrainer

from version_gates import refused, require_proven
from preference_helpers import _WORDS, TOLERANCE, GradientsAtStep, pair_examples, relative_l2, word_tokenizer
from vlm_pack.core.batch import METADATA_KEY
from vlm_pack.preference import LOSS_TYPES, PackedDPOTrainer, PreferenceCollator, sequence_logps
from vlm_pack.attention.shared_prefix import SHARED_PREFIX_KWARG, shared_prefix_keys
from vlm_pack.testing.tiny_families import mistral_text_config, tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import (_MODEL_CLASSES, offline_gemma3_processor, offline_qwen2vl_processor,
                                          tiny_model)

TEXT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@functools.lru_cache(maxsize=None)
def processor_of(family: str):
    """The word tokenizer (text families); the offline Qwen2-VL processor (the Qwen-VL families of
    vlm_pack.testing.tiny_models), Gemma 3's; the family's offline processor (vlm_pack.testing.tiny_families)."""
    if family in TEXT_FAMILIES:
        return word_tokenizer()
    if family == "gemma3":
        return offline_gemma3_processor()
    return offline_qwen2vl_processor() if family in _MODEL_CLASSES else tiny_vlm_processor(family)


def tiny_policy(family: str, seed: int):
    """A tiny 1-layer fp32 sdpa model of ``family`` (text families on the word tokenizer's vocabulary)."""
    vocab = len(_WORDS.split())
    if family == "mistral":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MistralForCausalLM._from_config(mistral_text_config(vocab, layers=1), attn_implementation="sdpa",
                                                   dtype=torch.float32)
    if family in _MODEL_CLASSES:
        return tiny_model(family, layers=1, seed=seed, vocab_size=vocab if family in TEXT_FAMILIES else None)
    return tiny_vlm(family, processor_of(family), layers=1, seed=seed)


@dataclass
class Run:
    trainer: DPOTrainer
    grads: dict[str, torch.Tensor]
    logs: dict[str, float]


def dpo_config(tmp: str, **overrides) -> DPOConfig:
    base = dict(
        output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, optim="sgd",
        learning_rate=0.1, max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, max_length=None,
        router_aux_loss_coef=0.0,  # MoE families: the router load-balancing loss is refused on packed pairs
    )
    return DPOConfig(**{**base, **overrides})


@functools.lru_cache(maxsize=None)
def run(family: str, mode: str, tmp: str, precompute: bool = False) -> Run:
    """One optimizer step: mode "trl" (the reference), "packed" or "shared" (packed, each prompt once);
    ``precompute``: reference log-probs precomputed over the dataset (TRL's ``precompute_ref_log_probs``)."""
    examples = pair_examples(images=family not in TEXT_FAMILIES)
    model, ref = (tiny_policy(family, seed) for seed in (0, 1))
    grads = GradientsAtStep()
    kwargs = dict(model=model, ref_model=ref, args=dpo_config(tmp, precompute_ref_log_probs=precompute),
                  train_dataset=datasets.Dataset.from_list(examples),
                  processing_class=processor_of(family), callbacks=[grads])
    if mode == "trl":
        trainer = DPOTrainer(**kwargs)
    else:
        collator = PreferenceCollator(processor_of(family), model_config=model.config, shared_prompts=mode == "shared")
        trainer = PackedDPOTrainer(data_collator=collator, **kwargs)
    trainer.train()
    return Run(trainer, grads.grads, trainer.state.log_history[0])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dpo"))


# Each case is one TRL step (cached per family) and one packed step: ~0.5 s (text) to ~2 s (VLM) here. Gemma 3
# refuses shared prompts (image blocks). LLaVA-OneVision and Mistral3 are refused (Proof.refused: the packed
# collator cannot concatenate their per-call padded pixel_values, measured with allow_unproven=True, while TRL's
# DPOTrainer serves them); GLM-4.6V is GLM-4V's code path (measured exact, left out for time). Gemma 4 unified (image
# blocks), LFM3-VL (short convolutions) refuse shared prompts; Nemotron-H Omni is refused (TRL's DPOTrainer fails on it).
CASES = [(family, mode) for family in ("llama", "qwen2", "qwen3", "mistral", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                                       "qwen3_vl_moe", "glm4v", "glm4v_moe", "internvl", "idefics3", "llava",
                                       "video_llama_3", "kimi_k25", "hyperclovax_vision_v2")
         for mode in ("packed", "shared")] + [(family, "packed") for family in ("gemma3", "gemma4_unified", "lfm3_vl")]


@pytest.mark.parametrize("family,mode", CASES)
def test_dpo_step_equals_trl(family, mode, tmp, one_thread):
    require_proven(family)
    reference, packed = run(family, "trl", tmp), run(family, mode, tmp)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        expected = reference.logs[key]
        assert abs(packed.logs[key] - expected) <= TOLERANCE * max(1.0, abs(expected)), key
    assert reference.logs["rewards/margins"] != 0.0  # the reference model differs: rewards are informative
    assert relative_l2(packed.grads, reference.grads) < TOLERANCE


def test_precomputed_reference_equals_trl(tmp, one_thread):
    """Text pairs with the reference log-probs precomputed by TRL's own pass over the dataset (packed rows here)."""
    reference, packed = run("llama", "trl", tmp, precompute=True), run("llama", "shared", tmp, precompute=True)
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        expected = torch.tensor(reference.trainer.train_dataset[key])
        assert torch.allclose(torch.tensor(packed.trainer.train_dataset[key]), expected, rtol=TOLERANCE)
    assert abs(packed.logs["loss"] - reference.logs["loss"]) <= TOLERANCE
    assert relative_l2(packed.grads, reference.grads) < TOLERANCE


# ---------------------------------------------------------------- per-pair log-probs and corruption tests

@pytest.fixture(scope="module")
def logps_setup(tmp):
    """TRL's per-pair reference log-probs (its own padded batch and code) and our packed model / batches."""
    reference, packed = run("qwen2_vl", "trl", tmp), run("qwen2_vl", "packed", tmp)
    examples = pair_examples(images=True)[:3]
    trl_batch = reference.trainer.data_collator([dict(e) for e in examples])
    with torch.no_grad():
        expected = torch.stack(reference.trainer.compute_ref_log_probs(reference.trainer.ref_model, trl_batch), 1)
    model = packed.trainer.ref_model
    collators = {shared: PreferenceCollator(processor_of("qwen2_vl"), model_config=model.config, shared_prompts=shared)
                 for shared in (False, True)}
    return expected, model, {shared: c(examples) for shared, c in collators.items()}


def pair_logps(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logps(model, batch)[0].view(-1, 2)


def pair_error(model, batch, expected) -> float:
    return float(((pair_logps(model, batch) - expected).abs() / expected.abs()).max())


@pytest.mark.parametrize("shared", [False, True])
def test_per_pair_logps_equal_trl(logps_setup, shared, one_thread):
    expected, model, batches = logps_setup
    assert pair_error(model, batches[shared], expected) < 1e-5


def _segments(batch) -> list[tuple[int, int]]:
    cu = batch["cu_seq_lens_q"].tolist()
    return list(zip(cu[:-1], cu[1:]))


def test_corruption_rejected_seeing_chosen_fails(logps_setup, one_thread):
    expected, model, batches = logps_setup
    batch = dict(batches[True])
    segments = _segments(batch)
    lengths = [end - start for start, end in segments]
    # Each rejected segment sees the WHOLE chosen segment (prompt and chosen answer) instead of the prompt only.
    prefixes = [(0, 0) if s % 2 == 0 else (segments[s - 1][0], lengths[s - 1]) for s in range(len(segments))]
    batch[SHARED_PREFIX_KWARG] = shared_prefix_keys(lengths, prefixes)
    assert pair_error(model, batch, expected) > 1e-3


def test_corruption_rejected_positions_restart_fails(logps_setup, one_thread):
    expected, model, batches = logps_setup
    batch = dict(batches[True])
    positions = batch["position_ids"].clone()
    for s, (start, end) in enumerate(_segments(batch)):
        if s % 2:  # the rejected continuation restarts at 0 instead of continuing from the prompt end
            positions[..., start:end] -= positions[..., start:start + 1].clone()
    batch["position_ids"] = positions
    assert pair_error(model, batch, expected) > 1e-3


def test_corruption_logps_summed_across_boundary_fails(logps_setup, one_thread):
    expected, model, batches = logps_setup
    batch = dict(batches[False])
    layout = dict(batch[METADATA_KEY]["preference"])
    labels, which = layout["shift_labels"].clone(), layout["sequence_of_target"].clone()
    for s, (start, end) in enumerate(_segments(batch)[:-1]):  # score the next sequence's first token as ours
        labels[0, end - 1], which[end - 1] = batch["input_ids"][0, end], s
    layout.update(shift_labels=labels, sequence_of_target=which)
    batch[METADATA_KEY] = {**batch[METADATA_KEY], "preference": layout}
    assert pair_error(model, batch, expected) > 1e-3


# ---------------------------------------------------------------- every loss type, and the refusals

@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_loss_type_equals_trl(loss_type, tmp, one_thread):
    """Each supported loss type on one micro-batch of tokenised text pairs (TRL's compute_loss vs ours)."""
    reference, packed = run("llama", "trl", tmp).trainer, run("llama", "packed", tmp).trainer
    rows = [reference.train_dataset[i] for i in range(3)]
    losses = []
    for trainer, batch in ((reference, reference.data_collator(rows)), (packed, packed.data_collator(rows))):
        trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
        trainer.label_smoothing = 0.1 if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
        with torch.no_grad():
            losses.append(float(trainer.compute_loss(trainer.model, batch)))
    assert abs(losses[1] - losses[0]) <= TOLERANCE * max(1.0, abs(losses[0])), losses


def test_refusals(tmp):
    processor = processor_of("qwen2_vl")
    gemma = tiny_model("gemma3", layers=1)
    with pytest.raises(ValueError, match=r"shared_prompts=True\) with a gemma3 model: its bidirectional image blocks"):
        PreferenceCollator(processor_of("gemma3"), model_config=gemma.config, shared_prompts=True)
    with pytest.raises(ValueError, match="needs model_config"):
        PreferenceCollator(processor)
    model = tiny_model("qwen2_vl", layers=1)
    dataset = datasets.Dataset.from_list(pair_examples(images=True))
    collator = PreferenceCollator(processor, model_config=model.config)
    for overrides, message in (({"use_weighting": True}, "WPO"), ({"ld_alpha": 0.5}, "LD-DPO"),
                               ({"loss_type": ["sigmoid", "unknown"]}, "not supported")):
        with pytest.raises(ValueError, match=message):
            PackedDPOTrainer(model=model, ref_model=tiny_model("qwen2_vl", layers=1), args=dpo_config(tmp, **overrides),
                             data_collator=collator, train_dataset=dataset, processing_class=processor)
    with pytest.raises(ValueError, match="PreferenceCollator"):
        PackedDPOTrainer(model=model, args=dpo_config(tmp), train_dataset=dataset, processing_class=processor)
    text = PreferenceCollator(word_tokenizer())  # no model_config: the trainer checks the model's family itself
    with refused(ValueError, r"PackedDPOTrainer with a qwen3_next model: DPO .* not proven", family="qwen3_next"):
        PackedDPOTrainer(model=tiny_model("qwen3_next", layers=1), ref_model=None, args=dpo_config(tmp), data_collator=text,
                         train_dataset=datasets.Dataset.from_list(pair_examples(images=False)),
                         processing_class=word_tokenizer())
    for family in ("mistral3", "llava_onevision"):  # refused (Proof.refused), even with allow_unproven=True
        config = tiny_policy(family, 0).config
        with pytest.raises(ValueError, match=rf"shared_prompts=False\) with a {family} model: .*torch.cat"):
            PreferenceCollator(processor_of(family), model_config=config, allow_unproven=True)
    with pytest.raises(ValueError, match="max_length=8"):
        PreferenceCollator(processor, model_config=model.config, max_length=8)(pair_examples(images=True)[:1])


def test_shared_prefix_rule_equals_dense_mask(one_thread):
    """The key-gather rule through varlen_attention equals SDPA with the explicit "prefix shared by two
    continuations" mask over the whole row (a prompt of 5, continuations of 4 and 1 + 3, then a plain sequence)."""
    from vlm_pack.attention.varlen import varlen_attention
    from vlm_pack.attention.shared_prefix import gather_shared_keys

    torch.manual_seed(0)
    lengths, prefixes = [9, 4, 6], [(0, 0), (0, 4), (0, 0)]  # segment 1 = prompt[-1] + rejected, sees prompt[:4]
    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, 8) for heads in (4, 2, 2))
    shared = shared_prefix_keys(lengths, prefixes)
    keys, values, cu_k, max_k = gather_shared_keys(shared, k, v)
    cu_q = torch.tensor([0, 9, 13, 19], dtype=torch.int32)
    out = varlen_attention(q[0].transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1), cu_q, cu_k,
                           9, max_k, causal=True)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, length in ((0, 9), (9, 4), (13, 6)):
        allowed[start:start + length, start:start + length] = torch.ones(length, length).tril().bool()
    allowed[9:13, 0:4] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert torch.allclose(out, expected[0].transpose(0, 1), atol=1e-6)
    allowed[9:13, 4:9] = True  # corruption: the continuation also sees the other continuation
    corrupted = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert not torch.allclose(out, corrupted[0].transpose(0, 1), atol=1e-3)


def test_batches_are_never_dispatched(tmp):
    """accelerate's dispatch_batches (its default for a streamed train or eval set) slices packed rows along dim 0:
    the trainer turns it off on the accelerator it built, and an explicit True is refused."""
    processor = processor_of("qwen2_vl")
    model = tiny_model("qwen2_vl", layers=1)
    kwargs = dict(model=model, ref_model=tiny_model("qwen2_vl", layers=1), processing_class=processor,
                  data_collator=PreferenceCollator(processor, model_config=model.config),
                  train_dataset=datasets.Dataset.from_list(pair_examples(images=True)))
    trainer = PackedDPOTrainer(args=dpo_config(tmp), **kwargs)
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    assert trainer.args.accelerator_config.dispatch_batches is False
    with pytest.raises(ValueError, match="PackedDPOTrainer: dispatch_batches=True cuts packed batches apart"):
        PackedDPOTrainer(args=dpo_config(tmp, accelerator_config={"dispatch_batches": True}), **kwargs)
