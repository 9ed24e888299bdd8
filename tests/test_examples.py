"""Each example runs end to end from its YAML recipe (reduced steps)."""

import importlib.util
import math
from pathlib import Path

import pytest

from vlm_pack.offline.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vlm_packed_example_trains():
    losses = load_example("finetune_vlm_packed").main(
        ["--config", str(ROOT / "configs" / "qwen2vl_in_batch_packing.yaml"), "--steps", "3"]
    )
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)


def test_recipe_rejects_unknown_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  stpes: 3\n")
    with pytest.raises(ValueError, match="stpes"):
        Recipe.from_yaml(path)
    path.write_text("trian:\n  steps: 3\n")
    with pytest.raises(ValueError, match="trian"):
        Recipe.from_yaml(path)


def test_llm_offline_example_prepares_then_trains(tmp_path):
    example = load_example("finetune_llm_offline_packed")
    config = str(ROOT / "configs" / "llm_offline_packing.yaml")
    losses = example.main(["--config", config, "--steps", "2", "--prepared-root", str(tmp_path)])
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    packs = list((tmp_path / "packed").glob("*/training_1024.npy"))
    assert len(packs) == 1 and (packs[0].parent / "1024_metadata.jsonl").exists()
    # a second run reuses the packs on disk instead of failing on existing output
    assert len(example.main(["--config", config, "--steps", "1", "--prepared-root", str(tmp_path)])) == 1
