"""Normalization layers: LayerNorm (BERT family) and RMSNorm (Qwen3), matching Hugging Face numerics."""

from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; kept here so every model imports its norms from one place."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
