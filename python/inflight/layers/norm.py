"""RMSNorm with transformers' numerics: normalise in fp32, cast back, then scale by the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same sequence as LlamaRMSNorm (x.float(), x * rsqrt(mean(x^2) + eps), .to(dtype), weight *),
    # but the normalisation is one fused op; for fp32 inputs .float()/.to() are no-ops.
    if x.dtype == torch.float32:  # skip two no-op casts: per-op overhead matters at small sizes
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
