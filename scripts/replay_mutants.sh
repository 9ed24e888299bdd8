#!/usr/bin/env bash
# Replay the planted bugs of issue 45 (scripts/mutants/*.patch): apply each to the working tree, run the test named
# on its first line ("# test: <pytest node id>"), expect that test to FAIL (pytest exit 1: a test failed, not a
# collection or usage error), then revert the patch. Prints one line per mutant and exits 1 if any survives.
# Run from the repository root on a clean tree: bash scripts/replay_mutants.sh [patch ...]
# (PYTHON: the interpreter, default python; the tests run with OMP_NUM_THREADS=1.)
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
patches=("$@")
[ ${#patches[@]} -eq 0 ] && patches=(scripts/mutants/*.patch)
survived=0
for patch in "${patches[@]}"; do
  test=$(sed -n '1s/^# test: //p' "$patch")
  if ! git apply --check "$patch" 2>/dev/null; then
    echo "NOT APPLIED  $(basename "$patch") (the code it mutates changed: regenerate the patch)"; survived=1; continue
  fi
  git apply "$patch"
  trap 'git apply -R "$patch"' EXIT INT TERM
  OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -x -p no:cacheprovider "$test" \
    >/dev/null 2>&1
  rc=$?
  git apply -R "$patch"
  trap - EXIT INT TERM
  if [ $rc -eq 1 ]; then
    echo "caught       $(basename "$patch")  by $test"
  else
    echo "SURVIVED     $(basename "$patch")  ($test exit $rc)"; survived=1
  fi
done
exit $survived
