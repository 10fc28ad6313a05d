"""Rotary position embedding (the rotate-half layout of Llama/Qwen3) for packed tokens."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes per-token cos/sin for ``positions`` and rotates head vectors with them.

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
        """(cos, sin), each [T, 1, head_dim / 2] in ``dtype``, for ``apply_rotary``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos()[:, None, :].to(dtype), freqs.sin()[:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by the per-token angles (rotate-half convention).

    With x = [x1, x2] split in halves: [x1 cos - x2 sin, x2 cos + x1 sin], which is
    transformers' ``x * cos + rotate_half(x) * sin`` with cos/sin repeated over both halves.
    Written on the halves (no roll, no gather), so torch.compile fuses it with the q/k norm
    into one kernel that reads and writes each row once.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
