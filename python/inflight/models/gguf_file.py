"""A GGUF file's metadata and tensor table, read in one pass.

``gguf.GGUFReader`` builds a numpy view per metadata item: for a file with a 262,144-token vocabulary
(Gemma 3) that is ~20 s before the first weight is read. :class:`GGUFFile` reads the same header with
``struct`` over one memory map: scalars, strings and arrays become Python values (numeric arrays one
``numpy`` array each), and every tensor's data is the view ``GGUFReader`` gives (typed for F32 / F16 /
integer tensors, raw ``uint8 [rows, bytes per row]`` for block-quantised ones), backed by the map.
The attributes used here are the reader's: ``fields[key].contents()``, ``len(fields[key].data)``, and
``tensors[i].name / .tensor_type / .shape / .data``. Little-endian files (all that llama.cpp writes).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFField", "GGUFFile", "GGUFTensor"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> (struct format, numpy dtype); 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# Tensor types with typed data (the rest are blocks of bytes).
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass
class GGUFField:
    name: str
    value: Any  # a Python scalar or str, a list of str, or a numpy array

    @property
    def data(self) -> Any:
        """What ``len()`` counts: the items of an array, else the value itself in a list."""
        return self.value if isinstance(self.value, (list, np.ndarray)) else [self.value]

    def contents(self) -> Any:
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # fastest dimension first, as the file lists it
    data: np.ndarray  # a read-only view of the mapped file


class GGUFFile:
    def __init__(self, path: str | os.PathLike) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"{os.fspath(path)!r} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self._pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = GGUFField(key, self._value(vtype))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            raw_type, offset = self._unpack("<IQ")
            infos.append((name, dims, raw_type, offset))
        align = self.fields.get("general.alignment")
        alignment = int(align.value) if align is not None else _DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment}")
        start = -(-self._pos // alignment) * alignment
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"GGUF tensor {name!r} appears twice")
            seen.add(name)
            kind = GGMLQuantizationType(raw_type)
            rows_first = tuple(reversed(dims))
            n_elems = int(np.prod(dims))
            block, type_size = GGML_QUANT_SIZES[kind]
            n_bytes = n_elems * type_size // block
            lo = start + offset
            raw = whole[lo : lo + n_bytes]
            if kind.name in _TYPED:
                data = raw.view(_TYPED[kind.name]).reshape(rows_first)
            else:  # blocks: [rows..., bytes per row]
                data = raw.reshape(*rows_first[:-1], rows_first[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data))

    # -- parsing ----------------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        s = self._map[self._pos + 8 : self._pos + 8 + n]
        self._pos += 8 + n
        return s.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            (v,) = self._unpack(_SCALARS[vtype][0])
            return v
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"GGUF metadata value type {vtype} is not known")
        item_type, count = self._unpack("<IQ")
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return arr
        if item_type == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(item_type) for _ in range(count)]  # arrays of arrays
