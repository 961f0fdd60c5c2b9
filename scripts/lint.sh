#!/usr/bin/env bash
# Style and structure checks; scripts/test.sh runs this first, so CI fails on a violation.
#   ruff (lint + format) over Python, clang-format over C++/CUDA, the import layers of the package
#   (scripts/check_imports.py) and the file-size rule (scripts/check_sizes.py).
# The tools are pinned (scripts/setup.sh installs them): a newer release may format differently.
# Usage: bash scripts/lint.sh            (check)
#        bash scripts/lint.sh --fix      (rewrite files in place: ruff --fix, ruff format, clang-format -i)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

cxx_files() { git ls-files -- 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.h' 'tests/cpp/*.cpp'; }

if [ "${1:-}" = "--fix" ]; then
  "$PY" -m ruff check --fix .
  "$PY" -m ruff format .
  cxx_files | xargs clang-format -i
  exit 0
fi

echo "== ruff check"
"$PY" -m ruff check .
echo "== ruff format --check"
"$PY" -m ruff format --check .
echo "== clang-format --dry-run -Werror"
cxx_files | xargs clang-format --dry-run -Werror
echo "== import layers"
"$PY" scripts/check_imports.py
echo "== file sizes"
"$PY" scripts/check_sizes.py
