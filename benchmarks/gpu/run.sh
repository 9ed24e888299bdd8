#!/usr/bin/env bash
# The GPU check in one command, from the repository root (docs/gpu_check.md):
#   bash benchmarks/gpu/run.sh             on the borrowed GPU machine (no network; wheels carried in .gpu_wheels/)
#   bash benchmarks/gpu/run.sh --dry-run   every stage on CPU at tiny shapes, in the running environment
# Installs the carried wheels (scripts/gpu_wheels.sh) into a temporary site folder, puts it and the checkout on
# PYTHONPATH and runs benchmarks/gpu/check.py: stages in order of value, each in its own time box, the report in
# ${OUT:-benchmarks/results}/gpu_report.md + gpu_results.json, the log in gpu_run.log. Extra arguments go to
# check.py (--stages, --box STAGE=SECONDS, --inject-failures). Exit status 0 when every stage is ok or skipped.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=.gpu_wheels
DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done
SITE=""
NOTE="none installed"
# check.py forks every stage from a parent that must not initialise CUDA: ask NVML, not the driver, if asked
export PYTORCH_NVML_BASED_CUDA_CHECK=1
probe() {  # empty when the modules import with the carried wheels first, else the error's last line
    local text
    text=$(PYTHONPATH="$SITE:$PWD" "$PYTHON" -c "import $1" 2>&1) || echo "$text" | tail -1
}

main() {
    if [ "$DRY" = 0 ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/vlm_pack_gpu_site.XXXXXX")
        trap 'rm -rf "$SITE"' EXIT
        if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
            echo "pip install failed: unpacking the wheels instead"
            for wheel in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
        fi
        NOTE="$(cd "$WHEELS" && ls *.whl | sed 's/-py.*\|-cp.*//' | paste -sd ' ')"
        error=$(probe transformers)
        if [ -n "$error" ]; then  # the carried transformers does not fit the image's packages: keep the image's pair
            echo "the carried transformers does not import ($error): using the image's transformers and huggingface_hub"
            rm -rf "$SITE"/transformers "$SITE"/transformers-*.dist-info \
                "$SITE"/huggingface_hub "$SITE"/huggingface_hub-*.dist-info
            NOTE="$NOTE (transformers + huggingface_hub wheels dropped: $error)"
        fi
        error=$(probe "datasets, trl")
        [ -n "$error" ] && NOTE="$NOTE; datasets / trl do not import: $error"
    fi
    echo "wheels: $NOTE"
    GPU_CHECK_WHEELS="$NOTE" PYTHONPATH="${SITE:+$SITE:}$PWD" OUT="$OUT" \
        "$PYTHON" -m benchmarks.gpu.check --out "$OUT" "$@"
}

main "$@" 2>&1 | tee "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"
