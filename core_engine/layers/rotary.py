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
        """(cos, signed_sin), each [T, 1, head_dim] in ``dtype``, for ``apply_rotary``.

        ``signed_sin`` is ``[-sin, sin]`` over the two halves, which turns rotate-half into a
        roll: x*cos + rotate_half(x)*sin == x*cos + roll(x, D/2)*signed_sin.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        cos = freqs.cos()
        return torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by the per-token angles (rotate-half convention), in three kernels."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)
