"""CPU detection: what the kernels are told about the CPU agrees with what Linux says (/proc/cpuinfo)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.ops import cpu_info, describe_cpu

if platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip("CPUID detection is x86-64 only", allow_module_level=True)


def _proc_cpuinfo() -> tuple[set[str], str, str]:
    flags, model, vendor = set(), "", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    return flags, model, vendor


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_features_agree_with_proc_cpuinfo():
    flags, model, vendor = _proc_cpuinfo()
    info = cpu_info()
    assert info["vendor"] == vendor
    assert info["model"] == model
    for ours, linux in [
        ("avx2", "avx2"),
        ("fma", "fma"),
        ("f16c", "f16c"),
        ("avx512f", "avx512f"),
        ("avx512bw", "avx512bw"),
        ("avx512vl", "avx512vl"),
        ("avx512dq", "avx512dq"),
        ("avx512bf16", "avx512_bf16"),
        ("avx512vnni", "avx512_vnni"),
        ("avx512fp16", "avx512_fp16"),
        ("amx_cpu", "amx_tile"),
    ]:
        assert info[ours] == (linux in flags), (ours, linux)
    # Usable AMX implies the CPU has it; on Linux >= 5.16 with the flag the permission is granted.
    assert info["amx_tile"] <= info["amx_cpu"]
    assert info["amx_bf16"] == (info["amx_tile"] and "amx_bf16" in flags)
    assert info["amx_int8"] == (info["amx_tile"] and "amx_int8" in flags)
    assert info["isa"] in ("portable", "avx2", "avx512f", "avx512")
    # The best path follows the flags: AVX-512 with BF16 and VNNI, AVX-512 without, AVX2, portable.
    avx512 = all(info[f] for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx2", "f16c"))
    if avx512 and info["avx512bf16"] and info["avx512vnni"]:
        want = "avx512"
    elif avx512:
        want = "avx512f"
    elif info["avx2"] and info["fma"] and info["f16c"]:
        want = "avx2"
    else:
        want = "portable"
    assert info["best_isa"] == want, (info, want)
    line = describe_cpu()
    assert line.startswith(model) and f"kernels {info['isa']}" in line


def test_forcing_a_lower_isa_is_reported():
    code = "from inflight.ops import cpu_info; print(cpu_info()['isa'])"
    env = {"INFLIGHT_CPU_ISA": "portable", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "portable"
