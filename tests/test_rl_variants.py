"""Packed rollouts beyond the GRPO matrix, each against TRL's own trainer on the same fixed completions:
RLOO (``PackedRLOOTrainer`` vs ``RLOOTrainer``), a LoRA policy whose reference is the adapter-free model (PEFT),
and bf16 autocast (TRL's default on CPU).

Same setup as tests/test_rl_grpo.py: 2 optimizer steps, gradient accumulation 2, 2 groups of 4 rollouts per
micro-batch, num_iterations 2, beta > 0; loss and step-2 gradients vs TRL's run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

from preference_helpers import relative_l2
from rl_helpers import G, MAX_COMPLETION, GradientsAtStep, examples, fixed, policy, processor_of, reward
from test_rl_grpo import TOLERANCE, _rel, make
from vlm_pack.rl import PackedGRPOTrainer, PackedRLOOTrainer


def _losses_close(ours: list[float], theirs: list[float]) -> bool:
    """Step losses within TOLERANCE x max(|loss|, 1) (tests/test_preference_dpo.py's rule): the losses are sums of
    advantage-weighted terms of size ~1 (normalised advantages) that cancel to ~1e-2, so 1 is their scale."""
    return len(ours) == len(theirs) == 2 and all(abs(a - b) <= TOLERANCE * max(abs(b), 1.0)
                                                 for a, b in zip(ours, theirs))


def _train(trainer) -> tuple[list[float], dict[str, torch.Tensor]]:
    grads = GradientsAtStep()
    trainer.add_callback(grads)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], grads.grads


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("rl"))


# ---------------------------------------------------------------- RLOO

@functools.lru_cache(maxsize=None)
def rloo(family: str, mode: str, tmp: str):
    args = RLOOConfig(
        output_dir=tmp, per_device_train_batch_size=2 * G, gradient_accumulation_steps=2, num_generations=G,
        max_completion_length=MAX_COMPLETION, beta=0.04, num_iterations=2, max_steps=2, optim="sgd",
        learning_rate=0.1, max_grad_norm=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0,
    )
    kwargs = dict(model=policy(family), reward_funcs=reward, args=args, train_dataset=examples(family),
                  processing_class=processor_of(family))
    trainer = fixed(RLOOTrainer)(**kwargs) if mode == "trl" else fixed(PackedRLOOTrainer)(share_prompts=True, **kwargs)
    return _train(trainer)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_rloo_shared_prompts_equal_trl(family, tmp, one_thread):
    (ref_losses, ref_grads), (losses, grads) = rloo(family, "trl", tmp), rloo(family, "shared", tmp)
    assert _losses_close(losses, ref_losses)
    assert relative_l2(grads, ref_grads) < TOLERANCE


# ---------------------------------------------------------------- PEFT: LoRA policy, reference = adapter disabled

def test_lora_shared_prompts_equal_trl(tmp, one_thread):
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    ref_losses, ref_grads = _train(make("llama", "trl", tmp, peft_config=lora()))
    trainer = make("llama", "shared", tmp, peft_config=lora())
    assert trainer.ref_model is None  # TRL's rule: the reference is the model with its adapter disabled
    losses, grads = _train(trainer)
    assert grads and all("lora_" in name for name in grads)
    assert _losses_close(losses, ref_losses)
    assert relative_l2(grads, ref_grads) < TOLERANCE


# ---------------------------------------------------------------- bf16 autocast

def test_bf16_within_trl_bf16_noise(tmp, one_thread):
    """bf16 changes every rounding, so the bound is TRL's own: our bf16 old log-probs sit no farther from the fp32
    values than 4 x TRL's bf16 ones do (fp32 truth: TRL's fp32 trainer, same batch, same weights)."""
    generations = {}
    for name, mode, bf16 in (("fp32", "trl", False), ("trl_bf16", "trl", True), ("ours_bf16", "shared", True)):
        trainer = make("llama", mode, tmp, bf16=bf16)
        trainer.model.train()
        generations[name] = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    mask = generations["fp32"]["completion_mask"].bool()
    truth = generations["fp32"]["old_per_token_logps"]
    trl_error = _rel(generations["trl_bf16"]["old_per_token_logps"], truth, mask)
    ours_error = _rel(generations["ours_bf16"]["old_per_token_logps"], truth, mask)
    assert 0 < trl_error and ours_error <= 4 * trl_error, (ours_error, trl_error)


def test_packed_trainer_class_is_exported():
    import vlm_pack

    assert vlm_pack.PackedGRPOTrainer is PackedGRPOTrainer and issubclass(PackedGRPOTrainer, GRPOTrainer)
