"""RMSNorm with transformers' numerics: Llama's (normalise in fp32, cast back, then scale by the
weight) and Gemma's (normalise and scale by ``1 + weight`` in fp32, then cast back)."""

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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x / rms(x)) * (1 + weight)`` computed in fp32, then cast to x's dtype (the
    checkpoint stores ``weight`` centred on 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)
