"""Normalization layers: LayerNorm (BERT family) and RMSNorm (Qwen3), matching Hugging Face numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; kept here so every model imports its norms from one place."""


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension.

    Uses torch's ``rms_norm`` (one fused kernel on CUDA; it accumulates in float32). In
    float32 it equals transformers' Qwen3RMSNorm exactly; in bf16 it differs by at most one
    rounding step, because transformers rounds to bf16 before applying the weight.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
