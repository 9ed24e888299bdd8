"""The supported torch / transformers range (vlm_pack.core.versions) and the declared floors.

Each ``>=`` floor of pyproject.toml is the ``==`` pin of scripts/floor_constraints.txt, the environment in which
scripts/check_floors.sh runs the suite (benchmarks/results/floors.md): a floor nobody ran cannot be declared.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from vlm_pack.core import versions
from vlm_pack.core.versions import GAPS, MINIMUM, check_supported, has

ROOT = Path(__file__).resolve().parents[1]


def declared_floors() -> dict[str, Version]:
    """``{package: floor}`` of every ``>=`` requirement in pyproject.toml (dependencies and every extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [line for extra in project["optional-dependencies"].values() for line in extra]
    floors: dict[str, Version] = {}
    for line in lines:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                name = requirement.name.lower().replace("_", "-")
                assert floors.setdefault(name, Version(spec.version)) == Version(spec.version), (
                    f"pyproject.toml gives {name} two floors")
    return floors


def floor_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "scripts" / "floor_constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = Version(version)
    return pins


def test_every_declared_floor_is_the_version_the_floor_check_runs():
    floors, pins = declared_floors(), floor_pins()
    # flash-linear-attention (extra "fla") is a CUDA/Triton kernel: never installed by the floor check
    untested = {name: floor for name, floor in floors.items()
                if name != "flash-linear-attention" and pins.get(name) != floor}
    assert not untested, f"floors not pinned in scripts/floor_constraints.txt (or pinned elsewhere): {untested}"
    assert pins.keys() <= floors.keys(), f"pins without a pyproject.toml floor: {pins.keys() - floors.keys()}"
    for package, minimum in MINIMUM.items():
        assert Version(minimum).release == floors[package].release[:len(Version(minimum).release)], package


@pytest.mark.parametrize("found,refused", [
    ({"torch": "2.10.1+cu128", "transformers": "5.24.0"}, ["torch>=2.11"]),
    ({"torch": "2.14.1", "transformers": "5.16.2"}, ["transformers>=5.17"]),
    ({"torch": "2.9.0", "transformers": "4.57.1"}, ["torch>=2.11", "transformers>=5.17"]),
])
def test_older_than_the_floor_is_an_import_error_naming_the_release(found, refused):
    with pytest.raises(ImportError) as error:
        check_supported({package: Version(version) for package, version in found.items()})
    assert all(f"'{needed}'" in str(error.value) for needed in refused), error.value
    assert "pip install -U" in str(error.value)


@pytest.mark.parametrize("found", [
    {"torch": "2.11.0+cu130", "transformers": "5.17.0"},  # the GPU image
    {"torch": "2.11.0.dev20260301", "transformers": "5.17.0.dev0"},  # pre-releases of the floor count as it
    {"torch": "2.14.1", "transformers": "5.24.0", "absent": None},
])
def test_the_supported_range_imports(found):
    versions_found = {package: None if version is None else Version(version) for package, version in found.items()}
    check_supported({package: version for package, version in versions_found.items() if package in MINIMUM})


def test_gaps_lie_inside_the_supported_range_and_follow_the_installed_release(monkeypatch):
    for name, gap in GAPS.items():
        assert Version(gap.since) > Version(MINIMUM[gap.package]), f"{name}: no supported release lacks it"
        for release, expected in (("5.17.0", False), (gap.since, True), (f"{gap.since}.1", True)):
            if gap.package == "torch":
                release = release.replace("5.17.0", "2.11.0+cu130")
            monkeypatch.setattr(versions, "installed", lambda package, r=release: Version(r))
            has.cache_clear()
            assert has(name) is expected, (name, release)
    has.cache_clear()


def test_families_and_features_proven_on_later_releases_are_refused_naming_it(monkeypatch):
    """transformers 5.17 (the GPU image): the families whose proof fails there, and the packed router loss, are
    refused with UnsupportedVersionError naming the release they are proven from; 5.24 passes them."""
    from types import SimpleNamespace

    from vlm_pack.models import UnsupportedVersionError, get_family, registered_families, version_problems

    families = registered_families()
    late = sorted(name for name, spec in families.items() if spec.proof.min_transformers is not None)
    # the six whose floor run failed on 5.17, and every family registered after the floor run (each proven by a
    # test file of its own, tests/test_family_<family>.py, which never ran on the floor)
    after_floor = {name for name, spec in families.items() if spec.proof.sft.startswith("tests/test_family_")}
    floor_failures = {"glm4v_moe", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_next", "vipllava"}
    assert after_floor and set(late) == floor_failures | after_floor
    router = SimpleNamespace(output_router_logits=True)
    for release, refused in (("5.17.0", True), ("5.24.0", False)):
        monkeypatch.setattr(versions, "installed", lambda package, r=release: Version(r))
        has.cache_clear()
        for name in late:
            problems = version_problems(families[name], SimpleNamespace())
            assert bool(problems) is refused and (not refused or "'transformers>=5.24'" in problems[0]), problems
        problems = version_problems(families["qwen3_vl_moe"], router)
        assert bool(problems) is refused and (not refused or "output_router_logits=False" in problems[0])
        assert not version_problems(families["qwen2_vl"], router)  # no router: nothing to refuse
    monkeypatch.setattr(versions, "installed", lambda package: Version("5.17.0"))
    has.cache_clear()
    from vlm_pack.testing.tiny_models import tiny_config

    with pytest.raises(UnsupportedVersionError, match=r"qwen3_5 family is proven exact from transformers 5\.24"):
        get_family(tiny_config("qwen3_5"))
    has.cache_clear()
