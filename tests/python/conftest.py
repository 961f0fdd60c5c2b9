from __future__ import annotations

import pytest


def _cuda_usable() -> bool:
    try:
        from inflight.cuda import cuda_available

        return cuda_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
