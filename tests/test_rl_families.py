"""Packed GRPO equals TRL's own ``GRPOTrainer`` on every registered causal family the packed rollouts serve: one
optimizer step per family and layout (packed; shared prompts) on the same fixed completions (tests/rl_helpers.py),
gradient accumulation 2, 2 groups of 4 rollouts per micro-batch, num_iterations 2 (old log-probs computed), beta > 0
(TRL's reference model): the step's loss and gradients, and the old and reference log-probs TRL's
``_generate_and_score_completions`` stored, against TRL's run. VLM prompts carry 1-2 images of different sizes.

The full matrix (every loss type, temperature, masking, the corruption tests) runs on Llama and Qwen2-VL in
tests/test_rl_grpo.py; the families here share its code path (one log-prob hook) and differ in what a family brings:
positions (1-D, mRoPE, GLM's 3-D RoPE), vision tensors (per image with grids, per image with sizes), the LM head.
Families whose vision inputs the rollout packer cannot split per rollout are refused by name when the trainer is
built (``FamilySpec.refused``). Tolerance: tests/test_rl_grpo.py's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from preference_helpers import relative_l2
from rl_helpers import GradientsAtStep
from test_rl_grpo import TOLERANCE, _loss_rel, _rel, _scale, make
from vlm_pack.models import UnsupportedModelError

FAMILIES = ("qwen2", "qwen3", "mistral", "qwen2_5_vl", "qwen3_vl", "glm4v")
MODES = ("packed", "shared")


@functools.lru_cache(maxsize=None)
def step(family: str, mode: str, tmp: str):
    """One optimizer step: (loss, gradients, the generation batches TRL scored)."""
    trainer = make(family, mode, tmp, max_steps=1)
    grads, scored = GradientsAtStep(), []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda batch: scored.append(generate(batch)) or scored[-1]
    trainer.add_callback(grads)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.grads, scored


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("grpo_families"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_step_equals_trl(family, mode, tmp, one_thread):
    (ref_losses, ref_grads, ref_scored), (losses, grads, scored) = step(family, "trl", tmp), step(family, mode, tmp)
    assert len(losses) == len(ref_losses) == 1 and len(scored) == len(ref_scored) >= 1
    for ours, theirs in zip(scored, ref_scored):
        mask = theirs["completion_mask"].bool()
        assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            assert _rel(ours[key], theirs[key], mask) < TOLERANCE, key
    assert _loss_rel(losses[0], ref_losses[0], _scale(ref_scored[0])) < TOLERANCE
    assert ref_grads and relative_l2(grads, ref_grads) < TOLERANCE
