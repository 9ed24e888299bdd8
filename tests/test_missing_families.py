"""Families vlm_pack has not proven, refused by name (``vlm_pack/models/missing.py``): the message names the rule
packing them would need and what ``allow_unproven=True`` would get wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from vlm_pack.models import UnsupportedModelError, get_family


def test_last_token_classifier_is_refused_naming_the_rule():
    """ShieldGemma 2 (a last-token classifier) is refused, naming why and what allow_unproven=True would get wrong."""
    config = transformers.ShieldGemma2Config()
    with pytest.raises(UnsupportedModelError, match=rf"model_type '{config.model_type}': ShieldGemma2ForImageClassification "
                                                    r"is a classifier.*reads logits\[:, -1\]"):
        get_family(config)


@pytest.mark.parametrize(("model_type", "rule"), [
    ("deepseek_ocr2", "local crops"),
    ("mistral_large4", "indexed .DeepSeek Sparse. attention"),
    ("glm5_next", "indexed .DeepSeek Sparse. attention"),
    ("voxtral", "mistral-common chat encoding"),
])
def test_families_needing_a_missing_rule_are_refused_by_name(model_type, rule):
    """Families whose packing needs a rule vlm_pack lacks: refused, naming the rule."""
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}': .*{rule}"):
        get_family(SimpleNamespace(model_type=model_type))
