"""Packed GRPO equals TRL's own ``GRPOTrainer`` on the same FIXED completions (generation replaced by fixed token
ids, ``tests/rl_helpers.py``; TRL's rewards, advantages, old / reference forwards and loss run as shipped).

Per model (tiny Llama, text; tiny Qwen2-VL, prompts with 1-2 images of different sizes) and layout (packed; shared
prompt), one trainer each does:

* ``train()``: 2 optimizer steps, gradient accumulation 2, 2 groups of 4 rollouts per micro-batch, beta > 0 (TRL's
  reference model), num_iterations = 2 (step 2 reuses step 1's rollouts: old log-probs differ from the policy);
  loss and the step-2 gradients vs TRL's run;
* on one generation batch at the initial weights (old and reference log-probs by each trainer's own
  ``_generate_and_score_completions``) and the policy moved off them (as at a later iteration), TRL's
  ``_compute_loss`` for every (loss type, beta, num_iterations) of the matrix and the extras (temperature 0.7,
  truncated completions masked, top-entropy masking, TRL's other loss types): loss, per-token log-probs, entropies
  and gradients vs TRL's on the same micro-batch.

Tolerance: 1e-4 relative (``tests/tolerance.py``'s stated gradient bound; measured errors are ~1e-6). Each packing
rule has a corruption test that must break the equality.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, split_pixel_values_by_grid, split_tensor_dict, \
    unsplit_pixel_values_by_grid

from preference_helpers import relative_l2
from rl_helpers import G, MAX_COMPLETION, GradientsAtStep, examples, fixed, policy, processor_of, reward
from tolerance import GRAD_REL_L2
from vlm_pack.attention.shared_prefix import SHARED_PREFIX_KWARG, shared_prefix_keys
from vlm_pack.rl import PackedGRPOTrainer
from vlm_pack.rl.layout import PackedRollouts

TOLERANCE = GRAD_REL_L2  # 1e-4: the bound; fp32 noise here is ~1e-6
FAMILIES = ("llama", "qwen2_vl")
MODES = ("packed", "shared")
LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "gspo")
MATRIX = [(loss, beta, nit) for loss in LOSSES for beta in (0.0, 0.04) for nit in (1, 2)]
EXTRAS = ["temperature", "truncated_masked", "entropy_mask", "cispo", "sapo", "luspo", "vespo"]


def grpo_config(tmp: str, **overrides) -> GRPOConfig:
    base = dict(
        output_dir=tmp, per_device_train_batch_size=2 * G, gradient_accumulation_steps=2, num_generations=G,
        max_completion_length=MAX_COMPLETION, beta=0.04, num_iterations=2, max_steps=2, optim="sgd",
        learning_rate=0.1, max_grad_norm=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0,
    )
    return GRPOConfig(**{**base, **overrides})


def make(family: str, mode: str, tmp: str, processor=None, peft_config=None, **overrides):
    kwargs = dict(model=policy(family), reward_funcs=reward, args=grpo_config(tmp, **overrides),
                  train_dataset=examples(family), processing_class=processor or processor_of(family),
                  peft_config=peft_config)
    if mode == "trl":
        return fixed(GRPOTrainer)(**kwargs)
    return fixed(PackedGRPOTrainer)(share_prompts=mode == "shared", **kwargs)


@dataclass
class Result:
    loss: float
    grads: dict[str, torch.Tensor]
    scale: float = 1.0
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class Run:
    trainer: GRPOTrainer
    train_losses: list[float]
    train_grads: dict[str, torch.Tensor]
    generation: dict
    results: dict[str, Result] = field(default_factory=dict)


def _micro(generation: dict) -> dict:
    """The generation batch's first micro-batch, unshuffled (2 whole groups): the same rows for every trainer."""
    return unsplit_pixel_values_by_grid(split_tensor_dict(split_pixel_values_by_grid(generation), 2)[0])


def _move_policy(model: torch.nn.Module) -> None:
    """The same small seeded step for every trainer: the policy is no longer the one that scored the rollouts."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=generator) * 0.02 * p.std().clamp(min=1e-3))


def _logps(trainer, inputs: dict):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    vision = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in inputs}
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True,
            num_images=inputs.get("num_images"), **vision)
    return logps, entropies


def _loss(trainer, inputs: dict, *, loss_type: str = "dapo", beta: float = 0.04, nit: int = 2,
          quantile: float = 1.0, with_logps: bool = False) -> Result:
    """TRL's ``_compute_loss`` (the trainer's own) and the policy gradient of one configuration."""
    model = trainer.model
    trainer.loss_type = "grpo" if loss_type == "gspo" else loss_type
    trainer.importance_sampling_level = "sequence" if loss_type in ("gspo", "luspo") else "token"
    trainer.beta = beta
    trainer.top_entropy_quantile = quantile
    if nit == 1:  # TRL then uses the policy's own detached log-probs (ratio 1)
        inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    result = Result(float(loss.detach()), grads, _scale(inputs), mask=inputs["completion_mask"].bool())
    if with_logps:
        result.logps, result.entropies = _logps(trainer, inputs)
    return result


@functools.lru_cache(maxsize=None)
def run(family: str, mode: str, tmp: str) -> Run:
    trainer = make(family, mode, tmp)
    grads = GradientsAtStep()
    trainer.add_callback(grads)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    # The matrix: one generation batch at the initial weights, the policy then moved (num_iterations > 1).
    trainer.model.load_state_dict(policy(family).state_dict())
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    generation = trainer._generate_and_score_completions(batch)
    out = Run(trainer, losses, grads.grads, generation)
    micro = _micro(generation)
    _move_policy(trainer.model)
    for loss_type, beta, nit in MATRIX:
        out.results[f"{loss_type}-beta{beta}-nit{nit}"] = _loss(
            trainer, micro, loss_type=loss_type, beta=beta, nit=nit, with_logps=(beta, nit) == (0.0, 1))
    out.results["entropy_mask"] = _loss(trainer, micro, quantile=0.3)
    for loss_type in ("cispo", "sapo", "luspo", "vespo"):
        out.results[loss_type] = _loss(trainer, micro, loss_type=loss_type)
    trainer.mask_truncated_completions = True
    masked = trainer._generate_and_score_completions(batch)
    trainer.mask_truncated_completions = False
    out.results["truncated_masked"] = _loss(trainer, _micro(masked), loss_type="grpo", with_logps=True)
    add_fused_lm_head(trainer.model, temperature=0.7, outputs=("log_probs", "entropy"))  # TRL's head, re-made
    out.results["temperature"] = _loss(trainer, micro, with_logps=True)
    add_fused_lm_head(trainer.model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("grpo"))


def _rel(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask].abs().max() / b[mask].abs().max())


def _scale(inputs: dict) -> float:
    """The size of a GRPO loss's terms: each token contributes about -advantage x ratio (+ beta x KL), and the
    group-normalised advantages sum to ~0, so the loss itself can cancel to far below its terms."""
    return float(inputs["advantages"].abs().mean())


def _loss_rel(a: float, b: float, scale: float) -> float:
    """Loss error relative to the larger of the loss and its terms' size (``_scale``)."""
    return abs(a - b) / max(abs(b), scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_equal_trl(family, mode, tmp, one_thread):
    """Two optimizer steps (gradient accumulation 2, num_iterations 2, beta > 0) through Trainer as users run it."""
    reference, packed = run(family, "trl", tmp), run(family, mode, tmp)
    assert len(packed.train_losses) == 2
    for ours, theirs in zip(packed.train_losses, reference.train_losses):
        assert _loss_rel(ours, theirs, _scale(reference.generation)) < TOLERANCE
    assert relative_l2(packed.train_grads, reference.train_grads) < TOLERANCE


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_old_and_reference_logps_equal_trl(family, mode, tmp, one_thread):
    reference, packed = run(family, "trl", tmp), run(family, mode, tmp)
    mask = reference.generation["completion_mask"].bool()
    assert torch.equal(packed.generation["completion_ids"], reference.generation["completion_ids"])
    assert torch.equal(packed.generation["advantages"], reference.generation["advantages"])
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert _rel(packed.generation[key], reference.generation[key], mask) < TOLERANCE, key


@pytest.mark.parametrize("case", [f"{a}-beta{b}-nit{n}" for a, b, n in MATRIX] + EXTRAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_trl(family, mode, case, tmp, one_thread):
    reference, packed = run(family, "trl", tmp).results[case], run(family, mode, tmp).results[case]
    assert reference.grads and relative_l2(reference.grads, {k: 0 * v for k, v in reference.grads.items()}) > 0
    assert _loss_rel(packed.loss, reference.loss, reference.scale) < TOLERANCE, (packed.loss, reference.loss)
    assert relative_l2(packed.grads, reference.grads) < TOLERANCE
    if reference.logps is not None:
        assert _rel(packed.logps, reference.logps, reference.mask) < TOLERANCE
        assert _rel(packed.entropies, reference.entropies, reference.mask) < TOLERANCE


# ---------------------------------------------------------------- corruption tests (each must break the equality)

def _hook_inputs(generation: dict) -> tuple[tuple, dict]:
    ids = torch.cat([generation["prompt_ids"], generation["completion_ids"]], 1)
    mask = torch.cat([generation["prompt_mask"], generation["completion_mask"]], 1)
    vision = {k: generation[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in generation}
    return (ids, mask, generation["completion_ids"].shape[1]), {"num_images": generation.get("num_images"), **vision}


def reference_error(family: str, mode: str, tmp: str, corrupt=None) -> float:
    """Our reference-model log-probs (through a corrupted layout) vs TRL's, on the same generation batch."""
    reference, packed = run(family, "trl", tmp), run(family, mode, tmp)
    trainer = packed.trainer
    packer = trainer._packers["train"]
    if corrupt is not None:
        trainer._packers["train"] = lambda *a, **k: corrupt(packer(*a, **k))
    try:
        args, kwargs = _hook_inputs(packed.generation)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, *args, **kwargs)
    finally:
        trainer._packers["train"] = packer
    expected = reference.generation["ref_per_token_logps"]
    return _rel(logps, expected, reference.generation["completion_mask"].bool())


def _segments(p: PackedRollouts) -> list[tuple[int, int, int]]:
    """(start, end, prefix length) of each segment of a shared-prompt row."""
    cu = p.inputs["cu_seq_lens_q"].tolist()
    cu_k = p.inputs[SHARED_PREFIX_KWARG]["cu_seqlens_k"].tolist()
    return [(a, b, (k1 - k0) - (b - a)) for a, b, k0, k1 in zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:])]


def see_siblings(p: PackedRollouts) -> PackedRollouts:
    """Each completion also sees the group's earlier completions (its prefix runs up to itself)."""
    prefixes, prompt_start = [], 0
    for start, end, prefix in _segments(p):
        if prefix == 0:
            prompt_start = start
        prefixes.append((0, 0) if prefix == 0 else (prompt_start, start - prompt_start))
    lengths = [end - start for start, end, _ in _segments(p)]
    p.inputs[SHARED_PREFIX_KWARG] = shared_prefix_keys(lengths, prefixes)
    return p


def restart_positions(p: PackedRollouts) -> PackedRollouts:
    """Completion positions restart at 0 instead of continuing from the prompt."""
    positions = p.inputs["position_ids"].clone()
    for start, end, prefix in _segments(p):
        if prefix:
            positions[..., start:end] -= positions[..., start:start + 1].clone()
    p.inputs["position_ids"] = positions
    return p


def mrope_from_token_count(p: PackedRollouts) -> PackedRollouts:
    """Completion mRoPE positions continue from the prompt's token count (the text row) instead of the model's rule
    (one more than the prompt's largest mRoPE position)."""
    positions = p.inputs["position_ids"].clone()
    for start, end, prefix in _segments(p):
        if prefix:
            positions[1:, ..., start:end] = positions[:1, ..., start:end]
    p.inputs["position_ids"] = positions
    return p


CORRUPTIONS = {"sibling": see_siblings, "restart": restart_positions, "mrope_count": mrope_from_token_count}


def test_reference_logps_exact_without_corruption(tmp, one_thread):
    assert reference_error("qwen2_vl", "shared", tmp) < TOLERANCE


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_layout_fails(name, tmp, one_thread):
    error = reference_error("qwen2_vl", "shared", tmp, CORRUPTIONS[name])
    assert error > 100 * TOLERANCE, f"{name}: {error:.3g}"


def test_corruption_normalisation_per_packed_row_fails(tmp, one_thread):
    """A loss normalised by the packed row's tokens (bnpo's rule) instead of TRL's dapo / grpo rules."""
    packed = run("qwen2_vl", "shared", tmp)
    micro = _micro(packed.generation)
    per_row = _loss(packed.trainer, micro, loss_type="bnpo")
    for case in ("dapo-beta0.04-nit2", "grpo-beta0.04-nit2"):
        reference = run("qwen2_vl", "trl", tmp).results[case]
        # measured: loss 29x (dapo) / 440x (grpo) the tolerance, gradients 690x / 5300x
        assert _loss_rel(per_row.loss, reference.loss, reference.scale) > 10 * TOLERANCE, case
        assert relative_l2(per_row.grads, reference.grads) > 100 * TOLERANCE, case


def test_corruption_old_logps_ignored_fails(tmp, one_thread):
    packed = run("qwen2_vl", "shared", tmp)
    ignored = _loss(packed.trainer, _micro(packed.generation), nit=1)  # ratio 1: old log-probs dropped
    reference = run("qwen2_vl", "trl", tmp).results["dapo-beta0.04-nit2"]
    assert relative_l2(ignored.grads, reference.grads) > 100 * TOLERANCE


# ---------------------------------------------------------------- bad input: a clear error at the first batch

def test_group_with_different_prompts_is_refused(tmp, one_thread):
    packed = run("llama", "shared", tmp)
    args, kwargs = _hook_inputs(packed.generation)
    ids = args[0].clone()
    split = ids.shape[1] - args[2]
    ids[1, split - 2] = (ids[1, split - 2] + 1) % 20 + 3
    with pytest.raises(ValueError, match=r"rollouts 0 and 1 belong to one group .* share_prompts=False"):
        packed.trainer._get_per_token_logps_and_entropies(packed.trainer.model, ids, *args[1:], **kwargs)


def test_group_with_the_same_prompt_ids_but_different_images_is_refused(tmp, one_thread):
    """Rollouts 0 and 1 of one group keep the same prompt ids, but rollout 1's image pixels differ (or its grid):
    one shared prompt would give rollout 1 rollout 0's image, so it is refused (share_prompts=False is the fix)."""
    packed = run("qwen2_vl", "shared", tmp)
    args, kwargs = _hook_inputs(packed.generation)
    rows = kwargs["image_grid_thw"].prod(-1).tolist()
    split = args[0].shape[1] - args[2]
    assert kwargs["num_images"][:2] == [1, 1] and torch.equal(args[0][0, :split], args[0][1, :split])
    pixels = kwargs["pixel_values"].clone()
    pixels[rows[0]:rows[0] + rows[1]] += 1.0  # rollout 1's image only
    with pytest.raises(ValueError, match=r"rollouts 0 and 1 belong to one group .* share_prompts=False"):
        packed.trainer._get_per_token_logps_and_entropies(packed.trainer.model, *args,
                                                          **{**kwargs, "pixel_values": pixels})
    grids = kwargs["image_grid_thw"].clone()  # the same pixels laid out on another grid (other mRoPE positions)
    t, h, w = grids[1].tolist()
    grids[1] = torch.tensor([t, w, h] if h != w else [t, 2 * h, w // 2])
    with pytest.raises(ValueError, match=r"rollouts 0 and 1 belong to one group .* share_prompts=False"):
        packed.trainer._get_per_token_logps_and_entropies(packed.trainer.model, *args,
                                                          **{**kwargs, "image_grid_thw": grids})


def test_completion_longer_than_max_is_refused(tmp, one_thread):
    packed = run("llama", "packed", tmp)
    (ids, mask, width), kwargs = _hook_inputs(packed.generation)
    ids, mask = torch.cat([ids, ids[:, -2:]], 1), torch.cat([mask, torch.ones_like(mask[:, -2:])], 1)
    mask[:, -width - 2:] = 1  # every completion now spans width + 2 > max_completion_length tokens
    with pytest.raises(ValueError, match=r"completion of 14 tokens > max_completion_length=12"):
        packed.trainer._get_per_token_logps_and_entropies(packed.trainer.model, ids, mask, width + 2, **kwargs)


def test_processor_padding_right_is_refused(tmp, one_thread):
    processor = offline_right_padded_processor()
    trainer = make("qwen2_vl", "shared", tmp, processor=processor)
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(ValueError, match=r"pads prompts on the right.*padding_side = 'left'"):
        trainer._generate_and_score_completions(batch)


def offline_right_padded_processor():
    from vlm_pack.testing.tiny_models import offline_qwen2vl_processor

    processor = offline_qwen2vl_processor()
    processor.tokenizer.padding_side = "right"
    return processor


def test_groups_split_across_micro_batches_are_refused(tmp):
    with pytest.raises(ValueError, match=r"per_device_train_batch_size \(6\) to be a multiple of the group size \(4\)"):
        make("llama", "shared", tmp, per_device_train_batch_size=6, steps_per_generation=2)


def test_group_shuffle_keeps_groups():
    from vlm_pack.rl.trainers import shuffle_groups

    rows = torch.arange(12)
    out = shuffle_groups({"rows": rows, "names": [str(i) for i in range(12)], "n": torch.tensor(3), "x": None}, 4)
    groups = out["rows"].view(3, 4)
    assert torch.equal(groups - groups[:, :1], torch.arange(4).expand(3, 4)) and set(groups[:, 0].tolist()) == {0, 4, 8}
    assert out["names"] == [str(int(i)) for i in out["rows"]] and out["n"] == 3 and out["x"] is None


def test_all_completions_masked_give_a_connected_zero(tmp, one_thread):
    """A micro-batch whose completions are all masked (truncated, ``mask_truncated_completions``) scores nothing
    but still returns a differentiable zero, as TRL's fused head does."""
    packed = run("llama", "shared", tmp)
    (ids, mask, width), kwargs = _hook_inputs(packed.generation)
    mask = mask.clone()
    mask[:, -width:] = 0
    logps, entropies, _ = packed.trainer._get_per_token_logps_and_entropies(
        packed.trainer.model, ids, mask, width, compute_entropy=True, **kwargs)
    assert logps.requires_grad and not logps.any() and not entropies.any() and logps.shape == ids[:, -width:].shape
