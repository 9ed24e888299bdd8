"""The logit transform the chunked loss applies is what each family's stock forward does to its head's output
(vlm_pack.models.logits: read from the config fields the installed release's forward uses, not from class names).

Families whose config carries a logit field (``logit_scale``, ``logits_scaling``, ``final_logit_softcapping``):
one sample alone through the stock sdpa model, the head's input recorded; the transform read, applied to the head's
output, equals the stock logits up to the rounding of one product (a divide done as a multiply by the inverse:
Granite). Caught (the corruption): the transform dropped where the forward applies one, and the config's fields
applied where the forward applies none (Aya Vision's ``logit_scale`` on transformers 5.24, which only 5.25's forward
applies; Cohere 2 Vision's on both). The chunked loss with the transform equals each sample alone in the families'
edge-batch tests (their ``own_loss``).
"""

from __future__ import annotations

import pytest
import torch

import test_vlm_families as families
from vlm_pack.core.chunked_loss import LMHead
from vlm_pack.integrations.head_loss import loss_owner
from vlm_pack.models.logits import SCALES, SOFTCAPS, LogitTransform, logit_transform

pytestmark = pytest.mark.usefixtures("one_thread")

LOGIT_FAMILIES = ["aya_vision", "cohere2_vision", "granite4_vision", "granite_docling", "gemma3n"]
# PaliGemma 2 (Gemma 2, built eager only): its final_logit_softcapping read and dropped in tests/test_family_paligemma.py

ROUNDING = 4 * torch.finfo(torch.float32).eps
"""Relative bound of the transform on identical fp32 logits: a multiply and a divide each round once (half an
ulp), a divide done as a multiply by the inverse rounds the inverse too, tanh adds one ulp."""


def _config_only(owner: torch.nn.Module) -> LogitTransform:
    """Every logit field of the config applied, whatever the forward does (the rule keyed by config alone)."""
    text = owner.config.get_text_config()
    scale = next((getattr(text, f) for f in sorted(SCALES) if getattr(text, f, None) is not None), None)
    softcap = next((getattr(text, f) for f in sorted(SOFTCAPS) if getattr(text, f, None) is not None), None)
    if getattr(text, "logits_scaling", None) is not None:
        scale = 1.0 / text.logits_scaling
    return LogitTransform(scale, softcap)


@pytest.mark.parametrize("family", LOGIT_FAMILIES)
@torch.no_grad()
def test_the_transform_read_is_what_the_stock_forward_does(family):
    setup = families.setup_for(family)
    inputs, _ = families.alone(setup, families.mixed_examples(1, seed=4)[0])
    owner = loss_owner(setup.stock)
    head = owner.get_output_embeddings()
    recorded = []
    handle = head.register_forward_pre_hook(lambda module, args: recorded.append(args[0]))
    try:
        stock = setup.stock(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    transform = logit_transform(owner)
    bound = ROUNDING * stock.abs().max().item()

    def error(rule: LogitTransform) -> float:
        return (LMHead(head, **rule.as_kwargs())(recorded[0]) - stock).abs().max().item()

    print(family, transform, "error", error(transform), "bound", bound)
    assert error(transform) <= bound
    other = LogitTransform() if transform != LogitTransform() else _config_only(owner)
    assert other != transform, f"{family}: its config carries no logit field"
    print(family, "corrupted", other, error(other))
    assert error(other) > 100 * bound
