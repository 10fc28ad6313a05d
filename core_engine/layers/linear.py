"""Fused projections: one matmul for Q, K and V, split into per-head views after; weight stacking helper."""

from __future__ import annotations

import torch
from torch import nn


class QKVLinear(nn.Module):
    """Projects hidden states to q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] with one matmul.

    The weight is the row-wise concatenation of the Hugging Face q, k and v weights
    (done at load time), so the three outputs are slices of one [T, (Hq + 2 Hkv) D] result.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.proj = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.proj(x)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = x.shape[0]
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )


def fuse_rows(*weights: torch.Tensor) -> torch.Tensor:
    """Concatenate Linear weights (or biases) along the output dimension."""
    return torch.cat(weights, dim=0).contiguous()
