"""Weight-only-quantised layers behind the model's linear seam (see :mod:`inflight.layers.linear`).

- :class:`W4A16Linear`: int4 weights (canonical layout of :mod:`inflight.ops.gemm`), scales (and
  offsets when asymmetric) per group; fused projections (q/k/v, gate/up) are loaded shard by shard.
- :class:`W8A16Linear`: int8 weights, one scale per group.
- :class:`W8A8Linear`: SmoothQuant's W8A8: int8 weights with one scale per output channel, int8
  activations quantised per token inside the kernel (after SmoothQuant's per-input-channel multipliers,
  ``smooth``); the products are summed exactly in int32.
- :class:`W8A16Embedding`: an int8 token embedding that is also the tied LM head: the lookup gathers
  int8 rows and dequantises only those; the head is a W8A16 GEMM over the whole vocabulary.

``set_activation_quantization("int8")`` makes a W4A16 / W8A16 (int8) layer run the A8 GEMM on the CPU
(:class:`~inflight.ops.gemm.A8Weight`: its input quantised to int8 per group of 32 on the fly, integer
products), as llama.cpp runs its quantised weights; ``"int16"`` runs the same GEMM with 16-bit codes
(A16: two int8 limbs, ~15 bits per group); the model-level switch is
``LLM(..., activation_quantization="int8" | "int16")``.

Build them through ``functools.partial`` as a model's ``linear_factory`` (or ``embedding_factory``);
activations keep the model dtype, weights stay quantised in memory.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import nn

from inflight.ops.gemm import (
    A8Weight,
    W4A16Weight,
    W8A8Weight,
    W8A16Weight,
    w4a16_gemm,
    w8a8_gemm,
    w8a16_gemm,
)
from inflight.quantization.w4a16 import GROUP_SIZES, W8_GROUP_SIZES, quantize_w4, quantize_w8

__all__ = ["ACTIVATION_QUANTIZATIONS", "W4A16Linear", "W8A8Linear", "W8A16Embedding", "W8A16Linear"]


# How the activations entering a weight-only-quantised layer are represented on the CPU: "none" (the
# model dtype), "int8" (the A8 GEMM) or "int16" (the same GEMM with two int8 limbs per element: A16).
ACTIVATION_QUANTIZATIONS = ("none", "int8", "int16")
_ACT_BITS = {"int8": 8, "int16": 16}

# W8A16Linear's weight formats: the dtype of qweight.
_W8_FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _check_group(in_features: int, group_size: int, allowed: tuple[int, ...] = GROUP_SIZES) -> None:
    if group_size not in allowed:
        raise ValueError(f"group_size must be one of {allowed}, got {group_size!r}")
    if in_features % group_size != 0:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")


class _FusedRows(nn.Module, abc.ABC):
    """Output rows split into shards (``output_sizes``); each checkpoint tensor fills one shard's rows."""

    def __init__(self, in_features: int, output_sizes: Sequence[int]) -> None:
        super().__init__()
        if in_features < 1 or not output_sizes or any(n < 1 for n in output_sizes):
            raise ValueError(
                f"bad layer shape: in_features={in_features}, output_sizes={tuple(output_sizes)}"
            )
        self.in_features = in_features
        self.output_sizes = tuple(int(n) for n in output_sizes)
        self.out_features = sum(self.output_sizes)
        offsets = [0]
        for n in self.output_sizes:
            offsets.append(offsets[-1] + n)
        self._row_offsets = tuple(offsets)
        self._packed = None  # the kernel's view of the weights (kernel_weight()), built on first use
        self.activation_quantization = "none"
        # Whether a packed copy (packs_a_copy()) replaces the checkpoint tensors (set_packed_only()), and the
        # tensors it replaced: name -> dtype, rebuilt from the packed copy when read.
        self._packed_only = False
        self._released: dict[str, torch.dtype] | None = None

    # ---- one copy of the weights --------------------------------------------------------------------
    # The A8 / A16 GEMM's and W8A8's packed weights are a copy (another layout) of qweight / scales (/
    # offsets). With
    # set_packed_only(), the layer drops those tensors once the copy is built (halving the weights'
    # memory) and rebuilds them, exactly, when anything reads them: an attribute read, state_dict(),
    # load_state_dict(), .to() / .cuda(). A read also drops the packed copy (the caller may write to the
    # tensors), so the next CPU forward packs again and drops the tensors again: a tensor kept from
    # before that no longer feeds the layer. named_buffers() does not list dropped tensors.

    def set_packed_only(self, on: bool = True) -> None:
        """Hold only the packed weights once they are built (the A8 / A16 GEMM's, W8A8's: see
        packs_a_copy; the other kernels read the tensors themselves). Off: the tensors are rebuilt now
        and kept."""
        self._packed_only = bool(on)
        if not self._packed_only:
            self._restore_originals()
        else:
            self._after_pack()

    def packs_a_copy(self) -> bool:
        """Whether the CPU kernel packs its own copy of the weights (the A8 / A16 GEMM's, W8A8's); the
        float-activation kernels read the tensors themselves."""
        return self.act_bits() != 0

    @property
    def originals_dropped(self) -> bool:
        """Whether the checkpoint tensors are dropped now (the packed copy holds the weights)."""
        return self._released is not None

    @property
    def weight_device(self) -> torch.device:
        """The weights' device (read without rebuilding dropped tensors)."""
        return torch.device("cpu") if self._released is not None else self.qweight.device

    def _drop_originals(self) -> None:
        if self._released is not None:
            return
        released = {}
        for name in ("qweight", "scales", "offsets"):
            t = self._buffers.get(name)
            if t is not None:
                released[name] = t.dtype
                del self._buffers[name]
        self._released = released

    def _unpacked(self) -> dict[str, torch.Tensor]:
        tensors = dict(zip(("qweight", "scales", "offsets"), self._packed.unpack()))
        return {name: tensors[name].to(dtype) for name, dtype in self._released.items()}

    def _restore_originals(self) -> None:
        if self._released is None:
            return
        tensors = self._unpacked()
        self._released = None
        self._buffers.update(tensors)
        self._packed = None

    def __getattr__(self, name: str):
        released = self.__dict__.get("_released")
        if released is not None and name in released:
            self._restore_originals()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._released is not None:  # rebuilt for the caller; the layer keeps the packed copy
            for name, t in self._unpacked().items():
                destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._restore_originals()
        self._packed = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _after_pack(self) -> None:
        if self._packed_only and isinstance(self._packed, (A8Weight, W8A8Weight)):  # copies, not views
            self._drop_originals()

    @torch.no_grad()
    def _copy_rows(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        dst = getattr(self, name, None)
        if not isinstance(dst, torch.Tensor) or name not in self.checkpoint_tensor_names():
            raise KeyError(f"{type(self).__name__} has no checkpoint tensor {name!r}")
        lo, hi = self._row_offsets[shard], self._row_offsets[shard + 1]
        dst = dst[lo:hi]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"shape mismatch for {name}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
            )
        if dst.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn) and tensor.dtype != dst.dtype:
            raise ValueError(f"{name} must be {dst.dtype}, got {tensor.dtype}")
        dst.copy_(tensor)

        # The kernel's view of the weights (W4A16Weight / W8A16Weight), built on the first CPU forward:
        # importing the tensors once makes a call cost ~1 us instead of ~10 (see inflight.ops.gemm).
        self._packed = None

    @abc.abstractmethod
    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensor names (suffixes) this layer loads."""

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        self._restore_originals()  # a shard overwrites part of the tensors: the rest must be there
        self._copy_rows(shard, name, tensor)
        self._packed = None

    def _apply(self, fn, recurse: bool = True):  # .to() / .cuda() / ... replace the tensors
        self._restore_originals()
        self._packed = None
        return super()._apply(fn, recurse)

    def supports_int8_activations(self) -> bool:
        """Whether :meth:`set_activation_quantization` can give this layer int8 activations."""
        return False

    def set_activation_quantization(self, mode: str) -> bool:
        """``"int8"``: the CPU forward runs the A8 GEMM (x quantised to int8 per group on the fly);
        ``"int16"``: the same GEMM with 16-bit codes (A16); ``"none"``: activations in the model dtype.
        Returns whether the layer now runs quantised activations (False for a layer without an A8
        kernel, which keeps its own)."""
        if mode not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(
                f"activation_quantization must be one of {list(ACTIVATION_QUANTIZATIONS)}, got {mode!r}"
            )
        mode = mode if self.supports_int8_activations() else "none"
        if mode != self.activation_quantization:
            self._restore_originals()  # the new kernel packs from the tensors
            self.activation_quantization = mode
            self._packed = None
        return mode != "none"

    def act_bits(self) -> int:
        """The A8 GEMM's activation bits for this layer's mode (8 or 16); 0 for the model dtype."""
        return _ACT_BITS.get(self.activation_quantization, 0)

    def _activation_repr(self) -> str:
        mode = self.activation_quantization
        return "" if mode == "none" else f", {mode} activations"


class W4A16Linear(_FusedRows):
    """``y = x @ dequant(W).T + b`` with int4 ``W`` (``qweight [N, K//2] uint8``) and per-group scales.

    Checkpoint tensors per shard: ``qweight``, ``scales``, ``offsets`` (asymmetric only), ``bias``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        group_size: int = 128,
        symmetric: bool = False,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__(in_features, output_sizes)
        _check_group(in_features, group_size)
        if in_features % 2 != 0:
            raise ValueError(f"in_features must be even for int4 packing, got {in_features}")
        self.group_size = group_size
        self.symmetric = symmetric
        self.dtype = dtype
        n, k, g = self.out_features, in_features, in_features // group_size
        # Uninitialised: every element is overwritten by load_shard (the model checks all were loaded).
        self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(n, g, dtype=scale_dtype, device=device))
        self.register_buffer(
            "offsets", None if symmetric else torch.empty(n, g, dtype=scale_dtype, device=device)
        )
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        names = ("qweight", "scales") if self.symmetric else ("qweight", "scales", "offsets")
        return names + (("bias",) if self.bias is not None else ())

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int = 128,
        symmetric: bool = False,
        dtype: torch.dtype | None = None,
        scale_dtype: torch.dtype = torch.float16,
    ) -> W4A16Linear:
        """Round-to-nearest quantisation of a float ``weight [N, K]`` (one shard)."""
        dtype = dtype if dtype is not None else weight.dtype
        layer = cls(
            weight.shape[1],
            (weight.shape[0],),
            bias is not None,
            dtype,
            weight.device,
            group_size=group_size,
            symmetric=symmetric,
            scale_dtype=scale_dtype,
        )
        qweight, scales, offsets = quantize_w4(weight, group_size, symmetric, scale_dtype)
        layer.load_shard(0, "qweight", qweight)
        layer.load_shard(0, "scales", scales)
        if offsets is not None:
            layer.load_shard(0, "offsets", offsets)
        if bias is not None:
            layer.load_shard(0, "bias", bias)
        return layer

    def supports_int8_activations(self) -> bool:
        return True

    def kernel_weight(self) -> W4A16Weight | A8Weight:
        """The CPU kernel's imported view of the weights (built once, rebuilt after a reload); with int8
        or int16 activations, the A8 GEMM's packed copy."""
        if self._packed is None:
            if self.act_bits():
                self._packed = A8Weight(
                    4,
                    self.qweight,
                    self.scales,
                    self.offsets,
                    self.group_size,
                    self.bias,
                    act_bits=self.act_bits(),
                )
                self._after_pack()
            else:
                self._packed = W4A16Weight(
                    self.qweight, self.scales, self.offsets, self.group_size, self.bias
                )
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu":
            y = self.kernel_weight()(x2)
        else:
            y = w4a16_gemm(x2, self.qweight, self.scales, self.offsets, self.group_size, bias=self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, group_size={self.group_size}, "
            f"symmetric={self.symmetric}, bias={self.bias is not None}" + self._activation_repr()
        )


class W8A16Linear(_FusedRows):
    """``y = x @ (scales * qweight).T + b`` with int8 ``qweight [N, K]``; tensors ``qweight``, ``scales``, ``bias``.

    ``weight_format="fp8_e4m3"``: ``qweight`` is ``float8_e4m3fn`` (an FP8 checkpoint's weight), converted
    exactly inside the kernels.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        group_size: int = 32,
        scale_dtype: torch.dtype = torch.float16,
        weight_format: str = "int8",
    ) -> None:
        super().__init__(in_features, output_sizes)
        _check_group(in_features, group_size, W8_GROUP_SIZES)
        if weight_format not in _W8_FORMATS:
            raise ValueError(f"weight_format must be one of {sorted(_W8_FORMATS)}, got {weight_format!r}")
        self.group_size = group_size
        self.dtype = dtype
        self.weight_format = weight_format
        n, k = self.out_features, in_features
        self.register_buffer("qweight", torch.empty(n, k, dtype=_W8_FORMATS[weight_format], device=device))
        self.register_buffer("scales", torch.empty(n, k // group_size, dtype=scale_dtype, device=device))
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "scales") + (("bias",) if self.bias is not None else ())

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int = 32,
        dtype: torch.dtype | None = None,
        scale_dtype: torch.dtype = torch.float16,
    ) -> W8A16Linear:
        dtype = dtype if dtype is not None else weight.dtype
        layer = cls(
            weight.shape[1],
            (weight.shape[0],),
            bias is not None,
            dtype,
            weight.device,
            group_size=group_size,
            scale_dtype=scale_dtype,
        )
        qweight, scales = quantize_w8(weight, group_size, scale_dtype)
        layer.load_shard(0, "qweight", qweight)
        layer.load_shard(0, "scales", scales)
        if bias is not None:
            layer.load_shard(0, "bias", bias)
        return layer

    def supports_int8_activations(self) -> bool:
        return self.weight_format == "int8"  # E4M3 bytes have no integer product

    def kernel_weight(self) -> W8A16Weight | A8Weight:
        """The CPU kernel's imported view of the weights (built once, rebuilt after a reload); with int8
        or int16 activations, the A8 GEMM's packed copy."""
        if self._packed is None:
            if self.act_bits():
                self._packed = A8Weight(
                    8, self.qweight, self.scales, None, self.group_size, self.bias, act_bits=self.act_bits()
                )
                self._after_pack()
            else:
                self._packed = W8A16Weight(self.qweight, self.scales, self.group_size, self.bias)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu":
            y = self.kernel_weight()(x2)
        else:
            y = w8a16_gemm(x2, self.qweight, self.scales, self.group_size, bias=self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, group_size={self.group_size}, "
            f"weight_format={self.weight_format}, bias={self.bias is not None}" + self._activation_repr()
        )


class W8A8Linear(_FusedRows):
    """``y = (x * smooth) @ (scales[:, None] * qweight).T + b`` with x quantised per token to int8
    (:class:`~inflight.ops.gemm.W8A8Weight`); tensors ``qweight [N, K]`` int8, ``scales [N]`` fp32,
    ``smooth [K]`` fp32 (shared by the fused shards: they read the same input), ``bias``. Every row
    count runs the W8A8 kernel (it is faster than W8A16 at each one measured, decode included), so a
    token's result never depends on the batch."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, output_sizes)
        self.dtype = dtype
        n, k = self.out_features, in_features
        self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(n, dtype=torch.float32, device=device))
        self.register_buffer("smooth", torch.ones(k, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)
        self._smooth_loaded = False

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "smooth") + (("bias",) if self.bias is not None else ())

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name != "smooth":
            super().load_shard(shard, name, tensor)
            return
        self._restore_originals()  # as the other tensors: the packed copy is rebuilt with the new vector
        if tuple(tensor.shape) != (self.in_features,):
            raise ValueError(
                f"shape mismatch for smooth: expected ({self.in_features},), got {tuple(tensor.shape)}"
            )
        tensor = tensor.to(torch.float32)
        if self._smooth_loaded and not torch.equal(self.smooth, tensor.to(self.smooth.device)):
            raise ValueError(
                "the fused shards of a W8A8 layer must share one smooth vector (they read the same input); "
                f"shard {shard} differs"
            )
        self.smooth.copy_(tensor)
        self._smooth_loaded = True
        self._packed = None

    def kernel_weight(self) -> W8A8Weight:
        if self._packed is None:
            bias = None if self.bias is None else self.bias.float()
            self._packed = W8A8Weight(self.qweight, self.scales, self.smooth, bias)
            self._after_pack()
        return self._packed

    def packs_a_copy(self) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu":
            y = self.kernel_weight()(x2.contiguous())
        else:  # a GPU: int8 tensor cores (cuBLASLt), the same bits
            y = w8a8_gemm(x2, self.qweight, self.scales, self.smooth, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
        )


class W8A16Embedding(W8A16Linear):
    """A token embedding stored as int8 rows (GGUF Q8_0) that doubles as the tied LM head.

    ``embed(ids)`` gathers the int8 rows of ``ids`` and dequantises only those (fp32, then the model
    dtype: the same values as dequantising the whole table); ``forward(hidden)`` is the LM head.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        group_size: int = 32,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__(
            embedding_dim,
            (num_embeddings,),
            False,
            dtype,
            device,
            group_size=group_size,
            scale_dtype=scale_dtype,
        )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._released is not None and ids.device.type == "cpu":  # the head's packed rows: same values
            flat = ids.reshape(-1)
            rows = torch.empty(flat.shape[0], self.embedding_dim, dtype=self.dtype)
            self._packed.embed(flat.to(torch.int64).contiguous(), rows)
            return rows.view(*ids.shape, self.embedding_dim)
        q = self.qweight.index_select(0, ids.reshape(-1))
        s = self.scales.index_select(0, ids.reshape(-1))
        g = self.embedding_dim // self.group_size
        rows = q.view(-1, g, self.group_size).to(torch.float32) * s.to(torch.float32).unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)
