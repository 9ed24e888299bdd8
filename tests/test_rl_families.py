"""Packed GRPO equals TRL's own ``GRPOTrainer`` on every registered causal family the packed rollouts serve: one
optimizer step per family and layout (packed; shared prompts) on the same fixed completions (tests/rl_helpers.py),
gradient accumulation 2, 2 groups of 4 rollouts per micro-batch, num_iterations 2 (old log-probs computed), beta > 0
(TRL's reference model): the step's loss and gradients, and the old and reference log-probs TRL's
``_generate_and_score_completions`` stored, against TRL's run. VLM prompts carry 1-2 images of different sizes.

The full matrix (every loss type, temperature, masking, the corruption tests) runs on Llama and Qwen2-VL in
tests/test_rl_grpo.py; the families here share its code path (one log-prob hook) and differ in what a family brings:
positions (1-D, mRoPE, GLM's 3-D RoPE), vision tensors (per image with grids, per image, InternVL's tiles counted
per rollout, Idefics3's tile stack per rollout), mixtures of experts (router auxiliary loss off: refused on packed rollouts). A family TRL itself cannot
run is refused by name when the trainer is built (``Proof.refused``), as is every family not proven here.
Tolerance: tests/test_rl_grpo.py's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from preference_helpers import relative_l2
from rl_helpers import GradientsAtStep
from test_rl_grpo import TOLERANCE, _loss_rel, _rel, _scale, make
from version_gates import require_proven
from vlm_pack.models import UnsupportedModelError

FAMILIES = ("qwen2", "qwen3", "mistral", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm46v", "glm4v_moe",
            "internvl", "idefics3", "llava", "hyperclovax_vision_v2")
MODES = ("packed", "shared")


@functools.lru_cache(maxsize=None)
def step(family: str, mode: str, tmp: str):
    """One optimizer step: (losses, gradients, the generation batches TRL scored, the trainer)."""
    trainer = make(family, mode, tmp, max_steps=1, router_aux_loss_coef=0.0)
    grads, scored = GradientsAtStep(), []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda batch: scored.append(generate(batch)) or scored[-1]
    trainer.add_callback(grads)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.grads, scored, trainer


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("grpo_families"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_step_equals_trl(family, mode, tmp, one_thread):
    require_proven(family)  # a family proven from a later release may not even build its fixture here
    (ref_losses, ref_grads, ref_scored, _), (losses, grads, scored, _) = step(family, "trl", tmp), step(family, mode, tmp)
    assert len(losses) == len(ref_losses) == 1 and len(scored) == len(ref_scored) >= 1
    for ours, theirs in zip(scored, ref_scored):
        mask = theirs["completion_mask"].bool()
        assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            assert _rel(ours[key], theirs[key], mask) < TOLERANCE, key
    assert _loss_rel(losses[0], ref_losses[0], _scale(ref_scored[0])) < TOLERANCE
    assert ref_grads and relative_l2(grads, ref_grads) < TOLERANCE


def _reference_logps(trainer, generation: dict, **vision) -> torch.Tensor:
    ids = torch.cat([generation["prompt_ids"], generation["completion_ids"]], 1)
    mask = torch.cat([generation["prompt_mask"], generation["completion_mask"]], 1)
    keys = ("pixel_values", "num_tiles", "pixel_attention_mask")
    vision = {**{k: generation[k] for k in keys if k in generation}, **vision}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, mask, generation["completion_ids"].shape[1], num_images=generation["num_images"],
            **vision)
    return logps


def _tiles_of_another_group(generation: dict) -> dict:
    """The vision tensors rotated by one group (4 rollouts of one prompt), counts kept: every rollout is handed
    another rollout's tiles (InternVL: the tile tensor by the first group's tiles; Idefics3: the per-rollout tile
    stacks and their masks)."""
    pixels = generation["pixel_values"]
    if "num_tiles" in generation:
        return {"pixel_values": pixels.roll(-generation["num_tiles"][0] * 4, 0)}
    return {"pixel_values": pixels.roll(4, 0), "pixel_attention_mask": generation["pixel_attention_mask"].roll(4, 0)}


@pytest.mark.parametrize("family", ["internvl", "idefics3"])
def test_corruption_tiles_of_another_rollout_fail(family, tmp, one_thread):
    """Tiles cut per rollout (InternVL: by TRL's num_tiles; Idefics3: one stack per rollout): the reference
    log-probs equal TRL's; with each rollout handed another rollout's tiles they do not."""
    reference, (*_, scored, trainer) = step(family, "trl", tmp)[2][0], step(family, "packed", tmp)
    mask, expected = reference["completion_mask"].bool(), reference["ref_per_token_logps"]
    assert _rel(_reference_logps(trainer, scored[0]), expected, mask) < TOLERANCE
    corrupted = _reference_logps(trainer, scored[0], **_tiles_of_another_group(scored[0]))
    assert _rel(corrupted, expected, mask) > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["llava_onevision", "mistral3", "gemma3", "llava_next"])
def test_unserved_families_are_refused_by_name_when_built(family, tmp):
    """Refused (TRL cannot run it; image blocks) or unproven: an UnsupportedModelError naming family and layout."""
    with pytest.raises(UnsupportedModelError, match=rf"PackedGRPOTrainer\(share_prompts=True\) with a {family} model"):
        make(family, "shared", tmp, max_steps=1)
