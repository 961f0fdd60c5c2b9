"""Packaging: import without a GPU, the lazily imported CUDA module, shipped type stubs."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys

import pytest

import inflight
from inflight.cuda import cuda_available, cuda_compiled, cuda_module, require_cuda_module


def test_import_in_a_clean_process_without_cuda_libraries():
    # No CUDA library path at all: the core module must not need libcudart or a driver.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = (
        "import inflight, inflight.batch_manager, inflight.executor.scheduler\n"
        "from inflight.cuda import cuda_compiled, cuda_available\n"
        "print(cuda_compiled(), cuda_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    compiled, available = out.stdout.split()
    assert available == "False"
    assert compiled in ("True", "False")


def test_type_stubs_are_shipped():
    files = importlib.resources.files("inflight")
    stub = files / "_C.pyi"
    assert stub.is_file()
    text = stub.read_text()
    for name in (
        "class LlmRequest",
        "class KVCacheManager",
        "class CapacityScheduler",
        "class RequestList",
        "def copy_block_tables",
    ):
        assert name in text
    if cuda_compiled():
        assert (files / "_C_cuda.pyi").is_file()


def test_cuda_module_reports_no_device_cleanly():
    if not cuda_compiled():
        with pytest.raises(RuntimeError, match="built without CUDA"):
            require_cuda_module()
        return
    mod = cuda_module()
    assert mod.runtime_version() >= 12000
    if not cuda_available():
        assert mod.device_count() == 0
        with pytest.raises(RuntimeError, match="no CUDA device"):
            require_cuda_module()
        with pytest.raises(RuntimeError):  # a call that needs the device raises, never crashes
            mod.fill(0, 16, 1.0, 1, 0)


@pytest.mark.cuda
def test_fill_kernel_on_gpu_next_to_torch_cuda_runtime():
    import torch

    mod = require_cuda_module()
    for n in (1, 17, 97, 1025, 1 << 20):
        out = torch.zeros(n, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        mod.fill(out.data_ptr(), n, 7, 0, stream)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.full((n,), 7, dtype=torch.int32))
    outf = torch.empty(33, dtype=torch.float32, device="cuda")
    mod.fill(outf.data_ptr(), 33, 2.5, 1, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(outf.cpu(), torch.full((33,), 2.5))


def test_version():
    assert inflight.__version__
