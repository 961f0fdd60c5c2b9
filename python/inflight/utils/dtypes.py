"""The one dtype-name table of the package: what ``dtype="..."`` means everywhere.

Names are torch's (``"float32"``, ``"bfloat16"``, ``"float16"``), with the short forms users bring from
vLLM and TensorRT-LLM (``fp32``, ``bf16``, ``fp16``, ``float``, ``half``) and ``"torch.float32"``-style
spellings. ``"auto"`` means "decide from the checkpoint and the device" and parses to ``None``.
"""

from __future__ import annotations

import torch

# The floating-point dtypes models, activations and the KV cache may have (the kernels' ScalarType).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(FLOAT_DTYPES.values())

_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


def parse_dtype(
    value: str | torch.dtype | None, name: str = "dtype", allow_auto: bool = True
) -> torch.dtype | None:
    """The torch dtype that ``value`` names; None for ``"auto"`` (or None) when ``allow_auto``.

    Raises ValueError naming ``name``, the value and the accepted spellings.
    """
    if isinstance(value, torch.dtype):
        if value in _NAMES:
            return value
    elif value is None:
        if allow_auto:
            return None
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key == "auto" and allow_auto:
            return None
        key = _ALIASES.get(key, key)
        if key in FLOAT_DTYPES:
            return FLOAT_DTYPES[key]
    auto = "'auto', " if allow_auto else ""
    raise ValueError(
        f"{name} must be {auto}'float32', 'bfloat16' or 'float16' (or fp32/bf16/fp16, or a torch dtype), "
        f"got {value!r}"
    )


# The KV cache may also be INT8: int8 codes with one fp32 scale per token per KV head (symmetric,
# max |x| / 127, computed when the token is stored; see inflight.layers.attention.Int8KvCache), or FP8:
# OCP E4M3 (e4m3fn) values, one byte each, with one scale per tensor for K and one for V (1.0; see
# inflight.layers.attention.Fp8KvCache). "fp8" parses to torch.float8_e4m3fn, the values' dtype; the
# pool holds their bytes as uint8 (torch's CPU kernels lack index_copy_ and others for float8).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_KV_ALIASES = {"fp8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8", "int8": "int8"}


def parse_kv_cache_dtype(
    value: str | torch.dtype | None, name: str = "KvCacheConfig.dtype"
) -> torch.dtype | None:
    """The KV cache dtype ``value`` names: a float dtype (as :func:`parse_dtype`), ``"int8"`` /
    ``torch.int8``, ``"fp8"`` (also ``"fp8_e4m3"``, ``"float8_e4m3fn"``) / ``torch.float8_e4m3fn``, or
    None for ``"auto"`` (the model's). Raises ValueError naming ``name``, the value and the accepted
    spellings."""
    if value is torch.int8 or value is torch.float8_e4m3fn:
        return value
    if isinstance(value, str):
        key = _KV_ALIASES.get(value.strip().lower().removeprefix("torch."))
        if key is not None:
            return KV_CACHE_DTYPES[key]
    try:
        return parse_dtype(value, name)
    except ValueError:
        raise ValueError(
            f"{name} must be 'auto', 'float32', 'bfloat16', 'float16', 'int8' or 'fp8' (or fp32/bf16/fp16, "
            f"fp8_e4m3, or a torch dtype of those), got {value!r}"
        ) from None


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """``torch.int8`` -> ``"int8"``, ``torch.float8_e4m3fn`` -> ``"fp8"``, float dtypes as :func:`dtype_name`."""
    if dtype is torch.int8:
        return "int8"
    if dtype is torch.float8_e4m3fn:
        return "fp8"
    return dtype_name(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name the kernels and configs use)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype}") from None


def checkpoint_dtype(name: str | None) -> torch.dtype:
    """The dtype a checkpoint's ``torch_dtype`` names; float32 when it names none we run."""
    if name is None:
        return torch.float32
    key = _ALIASES.get(name.lower().removeprefix("torch."), name.lower().removeprefix("torch."))
    return FLOAT_DTYPES.get(key, torch.float32)
