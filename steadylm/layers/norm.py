"""RMSNorm, computed in float32 as HF Llama does, then cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # HF's math exactly, weight included, in one kernel (one op fewer per norm).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # One fused kernel for x * rsqrt(mean(x^2) + eps) in fp32, as HF does, then the weight
        # on the value cast back to the model dtype (HF's rounding order).
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)
