#!/usr/bin/env bash
# Create .venv and install vlm_pack with everything the demo and the tests need, from the project's own files.
#
# Versions: scripts/constraints.txt pins every package to the release the test suite was proven with (torch and
# torchvision: the releases that install from local files on the dev/CI machines). To try newer releases of
# everything else, run `VLM_PACK_UNPINNED=1 bash scripts/setup.sh` and then the tests; when they pass, refresh the
# pins with `.venv/bin/pip freeze --exclude-editable > scripts/constraints.txt`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pins=(-c scripts/constraints.txt)
if [[ "${VLM_PACK_UNPINNED:-0}" == "1" ]]; then
    pins=()
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${pins[@]}" torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q "${pins[@]}" -e '.[test,examples,hf]'
