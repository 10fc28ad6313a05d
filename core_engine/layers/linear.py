"""Fused projections (one matmul for Q, K and V), the residual-branch projection, and weight stacking."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("fern::residual_linear", mutates_args=())
def residual_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as an op torch.compile cannot see into (see `ResidualLinear`)."""
    return F.linear(x, weight)


@residual_linear.register_fake
def _residual_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class ResidualLinear(nn.Linear):
    """A bias-free projection whose output is added to the residual stream: ``x + proj(h)``.

    Left to itself, torch.compile rewrites ``x + h @ W^T`` (when the sum also feeds a norm)
    into ``addmm(x, h, W^T)``, and on CUDA ``addmm`` with a separate output first copies
    ``x`` into that output, then lets cuBLAS read it again as the C operand: one device-to-
    device copy per residual, two per Qwen3 layer (56 extra kernels in every pplx-0.6b step).
    Here the matmul is an opaque op, so the add stays an add and torch.compile fuses it into
    the RMSNorm that reads the sum (Qwen3Layer places every residual add in front of a norm).
    On the H200 a 1x128 pplx-0.6b step went from 344 to 289 kernels and 1.24 to 1.18 ms of
    kernel time; its wall time and the 32x512 throughput stayed within their run-to-run spread.
    `opaque=False` (KernelOptions.opaque_residual) restores the folded form, to measure one against the other.
    """

    def __init__(self, in_features: int, out_features: int, opaque: bool = True) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.opaque = opaque

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return residual_linear(x, self.weight) if self.opaque else F.linear(x, self.weight)


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
