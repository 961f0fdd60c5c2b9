"""Host memory after loading: the process's resident size, handing the C heap's free pages back to the
operating system, and dropping the Python copies of a vocabulary that a tokenizer keeps after building
its fast (Rust) backend."""

from __future__ import annotations

import ctypes
from typing import Any


def resident_mib() -> float | None:
    """The process's resident set in MiB (Linux ``/proc/self/statm``), or None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import resource

    return pages * resource.getpagesize() / 2**20


def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc; absent on musl and macOS
    except OSError:
        return None


def release_free_heap() -> float | None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``, ~0.5 ms). Loading
    leaves much freed memory in the heap (a tokenizer's JSON parse, the checkpoint tensors replaced by
    packed copies) that the allocator would otherwise keep resident. No ``gc.collect()``: that garbage is
    freed by reference counting already, and a collection costs ~100 ms in a process holding torch and
    transformers (measured: the same resident size after loading Gemma 3 with or without it).
    Returns the MiB the resident set shrank by, or None where this is not available."""
    trim = _malloc_trim()
    before = resident_mib()
    if trim is None or before is None:
        return None
    trim(0)
    after = resident_mib()
    return None if after is None else max(0.0, before - after)


# Attributes in which transformers' tokenizer classes keep the vocabulary and merges they built their
# fast backend from; nothing reads them afterwards (encoding, decoding and saving use the backend).
_BUILD_TABLES = {"_vocab": dict, "_merges": list}


def drop_tokenizer_build_tables(tokenizer: Any) -> int:
    """Empty a fast tokenizer's Python copies of its vocabulary and merges (Gemma 3's 262k tokens and
    515k merges: ~125 MiB of Python objects). Only a tokenizer with a backend (``backend_tokenizer``)
    is touched; returns how many entries were dropped."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return 0
    dropped = 0
    for name, kind in _BUILD_TABLES.items():
        table = getattr(tokenizer, name, None)
        if isinstance(table, kind) and table:
            dropped += len(table)
            setattr(tokenizer, name, kind())
    return dropped
