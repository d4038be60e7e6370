"""RMSNorm, computed in float32 as HF Llama does, then cast back; optionally fused with the
residual add before it (vLLM's `RMSNorm(x, residual)` convention)."""

from __future__ import annotations

import torch
from torch import nn

from steadylm import kernels
from steadylm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual), the sum rounded to
        the model dtype first as HF's `residual + hidden_states` is. The native CPU kernel does
        the add and the norm in one pass (steadylm/kernels)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
