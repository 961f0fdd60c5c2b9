#!/usr/bin/env bash
# Sets up (scripts/setup.sh), checks style and structure (scripts/lint.sh), then runs the C++ unit
# tests (ctest) and the Python tests (pytest).
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh

echo "== lint"
bash scripts/lint.sh

echo "== building the C++ unit tests"
start=$(date +%s)
cmake -S . -B build/cpp-tests -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFLIGHT_BUILD_TESTS=ON \
  -DINFLIGHT_BUILD_PYTHON=OFF -DINFLIGHT_ENABLE_CUDA=OFF >/dev/null
cmake --build build/cpp-tests -j "$(nproc)"
echo "== C++ tests built in $(( $(date +%s) - start )) s"

echo "== ctest"
ctest --test-dir build/cpp-tests --output-on-failure -j "$(nproc)"

echo "== pytest"
# Run from the tests directory so that `import inflight` resolves to the installed package.
"$PY" -m pytest -q -p no:cacheprovider tests/python "$@"
