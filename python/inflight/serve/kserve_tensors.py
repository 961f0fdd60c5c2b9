"""Tensors of the KServe v2 / Open Inference Protocol: JSON ``data`` and Triton's binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes: the HTTP header
``Inference-Header-Content-Length`` gives the JSON part's length, and each input whose
``parameters.binary_data_size`` is set takes that many bytes, in input order. Numbers are
little-endian, row-major; a BYTES element is a 4-byte little-endian length and then its bytes. An
output is sent the same way when the request asks for it (``parameters.binary_data`` on the output,
or ``binary_data_output`` on the request), else as JSON ``data`` (BYTES as UTF-8 strings).

:func:`decode_request` and :func:`encode_response` are pure: the routes (:mod:`inflight.serve.kserve`)
and the gRPC servicer share them; :class:`TensorError` is a 400 with Triton's message.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

# KServe datatype -> numpy dtype (BYTES: numpy object arrays of bytes).
DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
HEADER_LENGTH = "Inference-Header-Content-Length"


class TensorError(ValueError):
    """A malformed request (HTTP 400, gRPC INVALID_ARGUMENT) with the message Triton would give."""


def _flatten(data: Any) -> list:
    if isinstance(data, list):
        out: list = []
        for x in data:
            out.extend(_flatten(x))
        return out
    return [data]


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise TensorError(f"input '{name}': shape must be a list of non-negative integers, got {shape!r}")
    return tuple(shape)


def deserialize_bytes(raw: bytes, count: int, name: str) -> np.ndarray:
    """``count`` BYTES elements (length-prefixed) from ``raw``."""
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(raw):
            raise TensorError(f"input '{name}': binary BYTES data ends inside an element's length")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise TensorError(f"input '{name}': binary BYTES element of {n} bytes runs past the data")
        out.append(raw[pos : pos + n])
        pos += n
    if pos != len(raw):
        raise TensorError(f"input '{name}': {len(raw) - pos} unexpected bytes after {count} BYTES elements")
    arr = np.empty(count, dtype=np.object_)
    arr[:] = out
    return arr


def serialize_bytes(values: np.ndarray) -> bytes:
    parts = []
    for v in values.reshape(-1):
        b = v if isinstance(v, bytes) else str(v).encode()
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


def _from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    flat = _flatten(data)
    count = math.prod(shape)
    if len(flat) != count:
        raise TensorError(
            f"input '{name}': shape {list(shape)} holds {count} elements, but {len(flat)} were given"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=np.object_)
        for i, v in enumerate(flat):
            if not isinstance(v, str):
                raise TensorError(f"input '{name}': a BYTES element must be a string in JSON, got {v!r}")
            arr[i] = v.encode()
        return arr.reshape(shape)
    for v in flat:
        ok = (
            isinstance(v, bool)
            if datatype == "BOOL"
            else isinstance(v, (int, float)) and not isinstance(v, bool)
        )
        if not ok:
            raise TensorError(f"input '{name}': element {v!r} is not of datatype {datatype}")
    try:
        return np.array(flat, dtype=DTYPES[datatype]).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise TensorError(f"input '{name}': {exc}") from None


def decode_request(body: bytes, header_length: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON header of an infer request and its inputs as numpy arrays (by name)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise TensorError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise TensorError(f"{HEADER_LENGTH} {n} is outside the body of {len(body)} bytes")
        head_raw, rest = body[:n], body[n:]
    else:
        head_raw, rest = body, b""
    try:
        head = json.loads(head_raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TensorError(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(head, dict):
        raise TensorError("the request must be a JSON object")
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise TensorError("the request must have a non-empty 'inputs' list")
    tensors: dict[str, np.ndarray] = {}
    pos = 0
    for item in inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise TensorError("each input must be an object with a 'name'")
        name = item["name"]
        datatype = item.get("datatype")
        if datatype not in DTYPES:
            raise TensorError(f"input '{name}': unknown datatype {datatype!r} (one of {', '.join(DTYPES)})")
        shape = _shape(name, item.get("shape"))
        if name in tensors:
            raise TensorError(f"input '{name}' is given twice")
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or pos + size > len(rest):
                raise TensorError(f"input '{name}': binary_data_size {size!r} runs past the binary data")
            raw = rest[pos : pos + size]
            pos += size
            count = math.prod(shape)
            if datatype == "BYTES":
                tensors[name] = deserialize_bytes(raw, count, name).reshape(shape)
            else:
                dtype = np.dtype(DTYPES[datatype])
                if len(raw) != count * dtype.itemsize:
                    raise TensorError(
                        f"input '{name}': {len(raw)} bytes of binary data for shape {list(shape)} of "
                        f"{datatype} (expected {count * dtype.itemsize})"
                    )
                tensors[name] = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape).copy()
        elif "data" in item:
            tensors[name] = _from_json(name, datatype, shape, item["data"])
        else:
            raise TensorError(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
    if pos != len(rest):
        raise TensorError(f"{len(rest) - pos} bytes of binary data belong to no input")
    return head, tensors


def encode_response(
    head: dict, outputs: list[tuple[str, str, np.ndarray]], binary: set[str]
) -> tuple[bytes, int | None]:
    """The response body: ``head`` plus ``outputs`` ((name, datatype, array)); those named in
    ``binary`` as raw bytes after the JSON. Returns (body, JSON length or None without binary)."""
    items, blobs = [], []
    for name, datatype, arr in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if name in binary:
            raw = (
                serialize_bytes(arr)
                if datatype == "BYTES"
                else np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif datatype == "BYTES":
            entry["data"] = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)
            ]
        else:
            entry["data"] = arr.reshape(-1).tolist()
        items.append(entry)
    text = json.dumps({**head, "outputs": items}, ensure_ascii=False, separators=(",", ":")).encode()
    if not blobs:
        return text, None
    return text + b"".join(blobs), len(text)
