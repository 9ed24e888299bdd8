#!/usr/bin/env bash
# The test suite on release sets of the Hugging Face stack, each overlaid on the project's virtualenv (torch shared;
# details: scripts/check_versions.py). Writes benchmarks/results/versions.md. The floor, the previous and the newest:
#
#     bash scripts/check_versions.sh floor transformers==5.24.0,accelerate==1.15.0 \
#         transformers==5.25.0,accelerate==1.16.0
#     bash scripts/check_versions.sh floor -- tests/test_x.py   # pytest arguments after "--" replace "-n 2"
#
# PYTHON: the virtualenv's interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/check_versions.py "$@"
