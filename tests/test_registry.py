"""The registry's proof status per training path: every claim names a test that exists, docs/families.md's table is
the registry's, a family declared without claims gets in-batch SFT only, and every entry point refuses an unproven
(family, path) pair by name when it is built (``allow_unproven=True`` where offered: a warning)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_pack import models
from vlm_pack.models import (PATHS, FamilySpec, ModelRules, Positions, Proof, UnsupportedModelError, families_proven,
                             get_family, path_refusal, registered_families, require_proven)
from vlm_pack.models.table import family_table, vlm_coverage, with_family_table

from version_gates import refused

ROOT = Path(__file__).resolve().parent.parent


def test_docs_families_table_is_the_generated_one():
    """The page is generated on one transformers release (named on it); an older one counts a smaller
    image-text-to-text mapping, so the page is checked on that release or later only."""
    from vlm_pack.core.versions import at_least, installed

    page = (ROOT / "docs" / "families.md").read_text()
    generated_on = re.search(r"image-text-to-text model types of transformers (\S+) ", page).group(1)
    if not at_least("transformers", generated_on):
        pytest.skip(f"docs/families.md is generated on transformers {generated_on} (installed: "
                    f"{installed('transformers')}, whose image-text-to-text mapping is smaller)")
    assert with_family_table(page) == page, "docs/families.md is stale: run python scripts/families_table.py"
    matched, total, version = vlm_coverage()
    assert f"{matched} of the {total} image-text-to-text model types of transformers {version}" in family_table()


def _collect(files: list[str]) -> set[str]:
    """Node ids of one collect-only run of ``files``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def test_every_claim_names_a_collected_test(request):
    """Each ``proven`` entry is the node id of a test pytest collects (so a claim cannot outlive its proof), and
    each family's SFT ``proof`` is a test file. The session's own items answer when it collected the claimed tests
    (the whole suite: free); the others are collected once, in a subprocess."""
    claims = {(spec.name, path): node for spec in registered_families().values() for path, node in
              spec.proof.proven.items()}
    for spec in registered_families().values():
        assert (ROOT / spec.proof.sft.split("::")[0]).is_file(), (spec.name, spec.proof.sft)
    session = {item.nodeid for item in request.session.items}
    unseen = {claim: node for claim, node in claims.items() if node not in session}
    if unseen:
        collected = _collect(sorted({node.split("::")[0] for node in unseen.values()}))
        unseen = {claim: node for claim, node in unseen.items() if node not in collected}
    assert not unseen, f"claims whose test does not exist: {unseen}"


def test_acceptance_counts():
    """The issue's bar: GRPO and DPO (both layouts) exact vs TRL and sequence parallelism exact on >= 8 families
    each; reward modelling on every registered family TRL's text-only RewardTrainer serves (>= 8)."""
    for path in ("rl", "rl_shared_prompt", "dpo", "dpo_shared_prompt", "sequence_parallel", "reward"):
        assert len(families_proven(path)) >= 8, path


def test_a_family_declared_without_claims_gets_in_batch_sft_only():
    spec = FamilySpec(name="newcomer", model_types=("newcomer",), proof=Proof("tests/test_families.py"))
    assert spec.proof.paths == {"sft"}
    for path in PATHS[1:]:
        with pytest.raises(UnsupportedModelError, match=rf"PackedThing with a newcomer model: .* not proven .*"
                                                         r"allow_unproven=True"):
            require_proven(spec, path, "PackedThing")
        with pytest.warns(UserWarning, match="not proven for this family"):
            require_proven(spec, path, "PackedThing", allow_unproven=True)
    with pytest.raises(UnsupportedModelError) as no_hatch:
        require_proven(spec, "sequence_parallel", "prepare_model", allow_unproven=None)
    assert "allow_unproven" not in str(no_hatch.value)  # an entry point without the escape hatch offers none


def test_claims_are_validated():
    with pytest.raises(ValueError, match="unknown training paths"):
        Proof("p", proven={"grpo": "t"})
    with pytest.raises(ValueError, match="in-batch SFT is always proven"):
        Proof("p", proven={"sft": "t"})
    with pytest.raises(ValueError, match="both proven and refused"):
        Proof("p", proven={"rl": "t"}, refused={"rl": "why"})
    with pytest.raises(ValueError, match="rope_index_model is required exactly when"):
        Positions("mrope")
    with pytest.raises(ValueError, match="image_blocks is required exactly when"):
        ModelRules(attention="causal_image_blocks")


def test_records_stay_small():
    """Each record of the registry holds at most 15 fields (one job per record; a new quirk goes to the record of
    its job, or a new record)."""
    modules = [importlib.import_module(f"vlm_pack.models.{info.name}") for info in pkgutil.iter_modules(models.__path__)]
    records = [value for module in modules for value in vars(module).values()
               if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == module.__name__]
    assert {record.__name__ for record in records} >= {"FamilySpec", "Proof", "ModelRules", "EncodingRules"}
    assert {record.__name__: len(dataclasses.fields(record)) for record in records if
            len(dataclasses.fields(record)) > 15} == {}


def test_refusals_hold_even_with_allow_unproven():
    gemma3 = registered_families()["gemma3"]
    assert path_refusal(gemma3, "sequence_parallel") and path_refusal(gemma3, "context_parallel")
    with pytest.raises(UnsupportedModelError, match="X with a gemma3 model: its bidirectional image blocks"):
        require_proven(gemma3, "rl", "X", allow_unproven=True)
    for path in PATHS:  # a claim never contradicts a refusal
        for spec in registered_families().values():
            assert not (path in spec.proof.paths and path_refusal(spec, path)), (spec.name, path)


# ---------------------------------------------------------------- each entry point refuses by name when built

def _config(family: str):
    from vlm_pack.testing.tiny_models import tiny_config

    return tiny_config(family, layers=1)


def test_collator_refuses_context_parallel_by_name():
    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    from vlm_pack.testing.tiny_families import mistral_text_config

    tokenizer, config = qwen_tokenizer(), mistral_text_config(1000, layers=1)
    assert "context_parallel" not in get_family(config).proof.paths
    with pytest.raises(UnsupportedModelError, match=r"context_parallel_size=2 with a mistral model: .* not proven"):
        VLMPackingCollator(tokenizer, max_length=64, model_config=config, context_parallel_size=2)
    with pytest.warns(UserWarning, match="context_parallel_size=2 with a mistral model"):
        VLMPackingCollator(tokenizer, max_length=64, model_config=config, context_parallel_size=2, allow_unproven=True)


def test_budget_planning_refuses_by_name():
    from vlm_pack.budget import measure_lengths
    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    collator = VLMPackingCollator(qwen_tokenizer(), max_length=64, model_config=_config("qwen3"))
    assert "budget" not in get_family(_config("qwen3")).proof.paths
    with pytest.raises(UnsupportedModelError, match=r"measure_lengths with a qwen3 model: token-budget packing"):
        measure_lengths([], collator, progress=False)


def test_preference_collator_refuses_by_name():
    from vlm_pack.preference import PreferenceCollator
    from vlm_pack.testing.tiny_models import qwen_tokenizer

    with refused(UnsupportedModelError, r"PreferenceCollator\(shared_prompts=False\) with a qwen3_next model",
                 family="qwen3_next"):
        PreferenceCollator(qwen_tokenizer(), model_config=_config("qwen3_next"))
    with refused(UnsupportedModelError, r"shared_prompts=True\) with a qwen3_5 model: its linear-attention",
                 family="qwen3_5"):
        PreferenceCollator(qwen_tokenizer(), model_config=_config("qwen3_5"), shared_prompts=True)


def test_sequence_parallel_refuses_by_name():
    from vlm_pack.sequence_parallel import prepare_model
    from vlm_pack.testing.tiny_models import tiny_model

    with refused(UnsupportedModelError, r"prepare_model\(sp_size=2\) with a qwen3_5 model: its linear",
                 gap="ulysses_trainer"):
        prepare_model(tiny_model("qwen3_5", layers=2), 2)
