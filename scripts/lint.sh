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
# The pinned binary from the clang-format wheel (not whatever clang-format is first on PATH).
CLANG_FORMAT=$("$PY" -c "import clang_format, os; print(os.path.join(os.path.dirname(clang_format.__file__), 'data', 'bin', 'clang-format'))")

cxx_files() { git ls-files -- 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.h' 'tests/cpp/*.cpp'; }

if [ "${1:-}" = "--fix" ]; then
  "$PY" -m ruff check --fix .
  "$PY" -m ruff format .
  cxx_files | xargs "$CLANG_FORMAT" -i
  exit 0
fi

echo "== ruff check"
"$PY" -m ruff check .
echo "== ruff format --check"
"$PY" -m ruff format --check .
echo "== clang-format --dry-run -Werror"
cxx_files | xargs "$CLANG_FORMAT" --dry-run -Werror
echo "== import layers"
"$PY" scripts/check_imports.py
echo "== file sizes"
"$PY" scripts/check_sizes.py
