#!/usr/bin/env bash
# One-command GPU check: build with CUDA, run the CUDA tests, run the kernel benchmarks.
#
#   benchmarks/gpu/check.sh OUT_DIR
#
# For a bare machine with an NVIDIA GPU, nvcc, Python 3.12 and torch (CUDA), nanobind,
# scikit-build-core, cmake, ninja, pytest and transformers preinstalled, and no network. Each stage has
# its own time limit (7 min 50 s in all, kill grace included); a failed stage is recorded and the next one still runs.
# Everything lands in OUT_DIR: one log per stage, summary.txt (stage, exit code, seconds),
# pytest.xml, bench_kernels.json. The exit code is the number of failed stages.
#
# Environment: INFLIGHT_CUDA_ARCHITECTURES (default: the GPU's own, e.g. 90) to choose what to compile.
set -u -o pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
: >"$OUT/summary.txt"
FAILED=0

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local note=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then note=" (timed out)"; fi
  if [[ $rc -ne 0 ]]; then FAILED=$((FAILED + 1)); fi
  echo "   $name: rc=$rc$note in $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  tail -n 5 "$OUT/$name.log" | sed 's/^/   | /'
  return 0
}

# nvcc is often installed but not on PATH.
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [[ -x "$d/nvcc" ]]; then export PATH="$d:$PATH"; break; fi
  done
fi
PY=${PYTHON:-python3}

ARCH=${INFLIGHT_CUDA_ARCHITECTURES:-}
if [[ -z "$ARCH" ]]; then
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
  ARCH=${ARCH:-90}
fi

stage environment 20 bash -c "nvidia-smi; echo; nvcc --version; echo; $PY -c 'import torch, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())'; cmake --version | head -n1; ninja --version"

# A build directory of its own: a build/ copied from another machine must not be reused.
stage build 200 env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps -v -e . \
  -Cbuild-dir=build/gpu-check \
  -Ccmake.define.INFLIGHT_CUDA_ARCHITECTURES="$ARCH" \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH"

stage import 20 "$PY" -c "
import inflight, inflight.cuda as c
m = c.require_cuda_module()
print('cuda ops:', sorted(n for n in dir(m) if not n.startswith('_')))
print('runtime', m.runtime_version(), 'driver', m.driver_version(), 'devices', m.device_count())
"

stage pytest 120 "$PY" -m pytest -m cuda -p no:cacheprovider -q -rs --durations=10 \
  --junitxml="$OUT/pytest.xml" tests/python/test_ops_cuda.py tests/python/test_ops_w8a8.py tests/python/test_package.py

stage bench 90 "$PY" benchmarks/gpu/bench_kernels.py --out "$OUT"

echo "== failed stages: $FAILED" | tee -a "$OUT/summary.txt"
exit "$FAILED"
