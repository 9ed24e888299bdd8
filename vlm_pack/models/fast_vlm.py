"""FastVLM (``fast_vlm``): a timm FastViT-MCi tower (convolutional stages, attention stages, one feature map per
image), a two-layer projector and a causal Qwen2 language model, LLaVA-style (``<image>`` placeholders, one
``pixel_values`` row per image). 1-D positions per sample.

Rules (proven in tests/test_family_fast_vlm.py against each sample alone through the stock sdpa model): the tower
runs on each image independently as long as its BatchNorm layers use their running statistics (eval mode), the
projector per token, and the image features fill the ``<image>`` tokens in sample order; the text is causal
(Qwen2, the registered text family) with positions restarting per sample.

Refused: a packed row through a tower whose BatchNorm layers are in training mode, at its forward: they would
normalise every image by the statistics of all images of the row, so a sample's features would depend on the other
samples (as they do in an unpacked micro-batch too; not what the sample alone computes). Fix:
:func:`freeze_batch_norm` (the tower's BatchNorm layers stay on their running statistics through ``model.train()``).
"""

from __future__ import annotations

import types

import torch

from .registry import register_family, text_backbone
from .spec import FamilySpec, ModelRules, Proof


def _batch_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _refuse_training_batch_norm(module, args, kwargs):
    """Forward pre-hook of ``FastVlmModel``: a packed row with images through a training-mode BatchNorm tower."""
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("pixel_values") is None:
        return None
    if any(norm.training for norm in _batch_norms(module.vision_tower)):
        raise ValueError(
            "FastVLM's vision tower has BatchNorm layers in training mode: they normalise every image of a packed row "
            "by the statistics of all its images, so samples would change each other's features. Call "
            "vlm_pack.models.fast_vlm.freeze_batch_norm(model) (running statistics, kept through model.train()), "
            "or train without packing"
        )
    return None


def _eval_only(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    return torch.nn.Module.train(self, False)


def freeze_batch_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Keep every BatchNorm layer of ``model``'s FastVLM vision tower on its running statistics (eval mode), also
    after ``model.train()``; their affine weights still train. Returns ``model``."""
    from transformers import FastVlmModel

    for inner in (m for m in model.modules() if isinstance(m, FastVlmModel)):
        for norm in _batch_norms(inner.vision_tower):
            norm.train = types.MethodType(_eval_only, norm)
            norm.train(False)
    return model


def _prepare(model: torch.nn.Module) -> None:
    """Hook every ``FastVlmModel`` (once) with the training-mode BatchNorm refusal."""
    from transformers import FastVlmModel

    for module in model.modules():
        if isinstance(module, FastVlmModel) and getattr(module, "_vlm_pack_norm_refusal", None) is None:
            module._vlm_pack_norm_refusal = module.register_forward_pre_hook(_refuse_training_batch_norm,
                                                                             with_kwargs=True)


FAST_VLM = register_family(FamilySpec(
    name="fast_vlm", model_types=("fast_vlm",),
    proof=Proof(
        "tests/test_family_fast_vlm.py",
        min_transformers="5.24",  # proven on 5.24 only (never run on the floor)
        proven={"budget": "tests/test_family_fast_vlm.py::test_planned_length_equals_the_real_processor[fast_vlm]"},
    ),
    model=ModelRules(extra_checks=(text_backbone("qwen2"),), prepare_model=_prepare),
))
