"""Linear projections, with checkpoint projections fused along the output dimension.

At these model sizes per-op overhead dominates, so q/k/v become one matmul and gate/up another:
a :class:`Linear` is built with ``output_sizes`` (e.g. ``(q_size, kv_size, kv_size)``) and each
checkpoint tensor is loaded into its shard with :meth:`Linear.load_shard`.

The seam for other weight formats (W4A16): a model builds every projection through a
:data:`LinearFactory` — ``factory(in_features, output_sizes, bias=..., dtype=..., device=...)`` — and
uses only three members of the result: ``forward(x)``, ``checkpoint_tensor_names()`` (the tensor
suffixes one shard expects from a checkpoint, e.g. ``("weight", "bias")`` or ``("qweight", "scales",
"offsets")``) and ``load_shard(shard, name, tensor)``. A quantised layer implements those three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from inflight.ops import batch_invariant
from inflight.ops.gemm import dense_gemm


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W = cat(shard_0, shard_1, ...)`` along the output dimension."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or not output_sizes or any(n < 1 for n in output_sizes):
            raise ValueError(
                f"bad Linear shape: in_features={in_features}, output_sizes={tuple(output_sizes)}"
            )
        self.in_features = in_features
        self.output_sizes = tuple(int(n) for n in output_sizes)
        self.out_features = sum(self.output_sizes)
        offsets = [0]
        for n in self.output_sizes:
            offsets.append(offsets[-1] + n)
        self._offsets = tuple(offsets)
        # Uninitialised: every element is overwritten by load_shard (the model checks all were loaded).
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self._kernel_weight = None  # kernel_weight(), built on first use

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def kernel_weight(self):
        """The weights imported once for the fused CPU layer stack (``inflight._C.DenseWeight``)."""
        if self._kernel_weight is None:
            from torch.utils.dlpack import to_dlpack

            from inflight import _C

            bias = None if self.bias is None else to_dlpack(self.bias.detach())
            self._kernel_weight = _C.DenseWeight(to_dlpack(self.weight.detach()), bias)
        return self._kernel_weight

    def _apply(self, fn, recurse: bool = True):  # .to() / .cuda() replace the tensors
        self._kernel_weight = None
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy (and cast) a checkpoint tensor into output rows ``offsets[shard] : offsets[shard + 1]``."""
        lo, hi = self._offsets[shard], self._offsets[shard + 1]
        if name == "weight":
            dst = self.weight[lo:hi]
        elif name == "bias" and self.bias is not None:
            dst = self.bias[lo:hi]
        else:
            raise KeyError(f"Linear has no checkpoint tensor {name!r}")
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"shape mismatch for {name}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
            )
        dst.copy_(tensor)
        self._kernel_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's CPU GEMM (oneDNN / MKL) picks its blocking by the number of rows, so a row's bits
        # depend on the batch; the dense kernel sums every element in one order (docs/architecture.md,
        # "Batch invariance").
        if x.is_cpu and self.weight.is_cpu and batch_invariant() and x.dim() >= 1:
            y = dense_gemm(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
        )


# (in_features, output_sizes, *, bias, dtype, device) -> module with forward / checkpoint_tensor_names / load_shard.
# A factory may also have for_module(layer_idx, name) -> the factory of that module (name: qkv_proj,
# o_proj, gate_up_proj, down_proj), when modules differ (a GGUF file's per-tensor types).
LinearFactory = Callable[..., nn.Module]
