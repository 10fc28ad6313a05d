"""The portable attention path: torch SDPA once per sequence over slices of the packed batch.

It runs on any device and is the reference the fused CUDA backends are held to. It reads
the slot boundaries on the host (``meta.cu_seqlens_cpu`` when given, otherwise one copy
of ``cu_seqlens``), so it is not CUDA-graph capturable; use it on CPU or for checks.

Grouped-query attention: K/V are passed to SDPA un-expanded with ``enable_gqa=True``.
On CPU (4-D float inputs, no mask) torch 2.13 picks its flash kernel, which reads the
grouped K/V heads in place: no repeat_interleave shows up in the profiler. Only the
per-sequence [H, L, D] transposes are copied. Were torch to fall back to its math kernel,
that kernel would expand K/V internally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_engine.attention.base import AttentionMetadata


class CpuAttention:
    """Packed attention as a loop of per-sequence ``scaled_dot_product_attention`` calls."""

    name = "cpu"

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.zeros_like(q)
        bounds = meta.cu_seqlens_cpu if meta.cu_seqlens_cpu is not None else meta.cu_seqlens
        bounds = bounds.tolist()
        gqa = q.shape[1] != k.shape[1]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            # [L, H, D] -> [1, H, L, D]. The batch dimension matters: torch only picks its
            # fused CPU flash kernel for 4-D inputs (3-D falls back to the math kernel, ~20x
            # slower), and contiguous heads make that kernel about twice as fast again.
            qs = q[start:end].transpose(0, 1).contiguous()[None]
            ks = k[start:end].transpose(0, 1).contiguous()[None]
            vs = v[start:end].transpose(0, 1).contiguous()[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=meta.causal, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out
