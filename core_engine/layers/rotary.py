"""Rotary position embedding (the rotate-half layout of Llama/Qwen3) for packed tokens."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for each token's position and rotates q/k heads with them.

    cos/sin are computed from ``positions`` every forward (one small outer product shared by
    all layers) rather than gathered from a table, so any position up to the model limit
    works without a large cache and the op stays CUDA-graph friendly.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # Built on the CPU explicitly so a model constructed on the meta device still has it.
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] in ``dtype`` for ``positions`` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by the per-token angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
