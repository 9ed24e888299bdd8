#!/usr/bin/env bash
# The declared floors, run: build a virtualenv holding the OLDEST release of each package pyproject.toml claims
# (scripts/floor_constraints.txt: torch 2.11 / transformers 5.17 / accelerate 1.15, the borrowed GPU image's, and
# every other ">=" of pyproject.toml) and run the test suite there against this checkout.
#
# CI cannot afford a second multi-GB virtualenv (torch 2.11 from PyPI is a CUDA build of ~4 GB), so this committed
# check is the proof of the floors; its measured result is benchmarks/results/floors.md. Run it after changing a
# floor or a version-dependent path (vlm_pack/core/versions.py):
#
#     bash scripts/check_floors.sh                 # whole suite, 2 workers
#     bash scripts/check_floors.sh tests/test_x.py # pytest arguments replace the default "-n 2"
#
# VLM_PACK_FLOOR_VENV (default .venv-floor, git-ignored) is where the virtualenv lives; PYTHON the interpreter that
# builds it (default python3; the GPU image has Python 3.12). An existing virtualenv is reused (pip checks pins).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLM_PACK_FLOOR_VENV:-.venv-floor}"
[[ -x "$venv/bin/python" ]] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q -c scripts/floor_constraints.txt)
"${pip[@]}" setuptools wheel torch torchvision
# The project's requirements (dependencies + the test / examples / hf extras), pinned by the floor constraints so
# nothing upgrades; the checkout is imported through PYTHONPATH. deepspeed is source-only: it is built against
# the torch above (an isolated build would fetch another torch), with none of its C++ ops.
"$venv/bin/python" - > "$venv/floor_requirements.txt" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(dict.fromkeys(project["dependencies"] + extras["test"] + extras["examples"] + extras["hf"])))
PY
DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation -r "$venv/floor_requirements.txt"
# The vlm-pack command the docs' bash blocks run: an editable install without dependencies (PYTHONPATH still wins).
"${pip[@]}" --no-build-isolation --no-deps -e .
"$venv/bin/python" -m pip freeze > "$venv/floor_freeze.txt"
grep -iE '^(torch|torchvision|transformers|accelerate|trl|datasets|numpy|numba|peft|deepspeed|megatron-core|megatron_core)==' \
    "$venv/floor_freeze.txt"
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(-n 2)
PYTHONPATH="$PWD" OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q "${args[@]}"
