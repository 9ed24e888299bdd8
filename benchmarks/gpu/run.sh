#!/usr/bin/env bash
# The GPU check in one command, from the repository root (docs/gpu_check.md):
#   bash benchmarks/gpu/run.sh             on the borrowed GPU machine (no network; wheels carried in .gpu_wheels/)
#   bash benchmarks/gpu/run.sh --dry-run   the same path on CPU at tiny shapes (the rehearsal)
# Both modes install the carried wheels (scripts/gpu_wheels.sh) into a temporary site folder when .gpu_wheels/
# holds any (--no-wheels: use the running environment as it is), run the deep import probe
# (benchmarks/gpu/probe.py: model classes, Trainer, vlm_pack.integrations, trl's GRPOTrainer; a carried
# transformers that does not import beside the image's packages is dropped for the image's own, and the report says
# so), then benchmarks/gpu/check.py: stages in order of value, each in its own time box, the whole run inside
# GPU_CHECK_BUDGET_S (default 525 s, counted from this script's start). Report: ${OUT:-benchmarks/results}/
# gpu_report.md + gpu_results.json, the log gpu_run.log. Other arguments go to check.py (--stages, --box
# STAGE=SECONDS, --inject-failures). Exit status 0 when every stage is ok or skipped and every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s.%N)}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${GPU_CHECK_WHEEL_DIR:-.gpu_wheels}
USE_WHEELS=1
ARGS=()
for arg in "$@"; do
    if [ "$arg" = "--no-wheels" ]; then USE_WHEELS=0; else ARGS+=("$arg"); fi
done
# Nothing may reach the network (the machine has none: a lookup would only hang until its timeout), output is
# unbuffered (a stage killed by its box keeps every line it printed), and the caller's PYTHONPATH is kept, after
# the carried wheels and the checkout.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TOKENIZERS_PARALLELISM=false
# check.py forks every stage from a parent that must not initialise CUDA: ask NVML, not the driver, if asked
export PYTORCH_NVML_BASED_CUDA_CHECK=1
SITE=""
NOTE="none installed"
PROBE_JSON=$(mktemp "${TMPDIR:-/tmp}/vlm_pack_gpu_probe.XXXXXX")

path_with_site() { echo "${SITE:+$SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"; }

install_wheels() {  # every carried wheel into $SITE; a wheel pip refuses is named, the others still installed
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/vlm_pack_gpu_site.XXXXXX")
    local start=$SECONDS refused=()
    if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
        echo "no pip for $PYTHON: unpacking the wheels instead (no dependency check)"
        for wheel in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
    elif ! "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
        echo "pip refused the wheels together: installing them one at a time"
        for wheel in "$WHEELS"/*.whl; do
            "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$wheel" \
                || refused+=("$(basename "$wheel")")
        done
    fi
    NOTE="$(cd "$WHEELS" && ls *.whl | sed 's/-py[0-9.]*-none.*\|-cp[0-9].*//' | paste -sd ' ' -)"
    [ ${#refused[@]} -gt 0 ] && NOTE="$NOTE; NOT installed (pip refused): ${refused[*]}"
    echo "wheels installed into $SITE in $((SECONDS - start)) s: $NOTE"
}

deep_probe() {
    PYTHONPATH="$(path_with_site)" "$PYTHON" -m benchmarks.gpu.probe --json "$PROBE_JSON"
}

main() {  # runs in the pipeline's subshell: its own EXIT trap removes the temporary folders
    trap 'rm -rf "$PROBE_JSON" ${SITE:+"$SITE"}' EXIT
    if [ "$USE_WHEELS" = 1 ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        install_wheels
    elif [ "$USE_WHEELS" = 0 ]; then
        NOTE="none installed (--no-wheels: the running environment as it is)"
    fi
    echo "wheels: $NOTE"
    if ! deep_probe && [ -n "$SITE" ] && ls -d "$SITE"/transformers >/dev/null 2>&1; then
        # the carried transformers does not fit the image's packages: keep the image's pair and probe again
        echo "the deep probe failed with the carried transformers: using the image's transformers and huggingface_hub"
        rm -rf "$SITE"/transformers "$SITE"/transformers-*.dist-info \
            "$SITE"/huggingface_hub "$SITE"/huggingface_hub-*.dist-info
        NOTE="$NOTE (transformers + huggingface_hub wheels dropped: the deep probe failed with them)"
        deep_probe || echo "the deep probe still fails: the stages that need the failed groups will say so"
    fi
    GPU_CHECK_WHEELS="$NOTE" GPU_CHECK_PROBE="$PROBE_JSON" PYTHONPATH="$(path_with_site)" OUT="$OUT" \
        "$PYTHON" -u -m benchmarks.gpu.check --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
}

main 2>&1 | tee "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"
