#!/usr/bin/env bash
# Create .venv and install vlm_pack with everything the demo and the tests need, from the project's own files.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch/torchvision pinned: these releases install from local files on the dev/CI machines.
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q -e '.[test,examples,hf]'
