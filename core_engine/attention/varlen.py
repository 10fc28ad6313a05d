"""Packed attention on CUDA through torch's `varlen_attn` (FlashAttention-2 varlen), graph-capturable."""

from __future__ import annotations

import inspect
import logging

import torch

from core_engine.attention.base import AttentionMetadata

log = logging.getLogger(__name__)


class VarlenAttention:
    """`torch.nn.attention.varlen.varlen_attn` over the packed batch; the CUDA default.

    Everything it needs is on the device (cu_seqlens) or a host int fixed per graph key
    (max_seqlen), so it records into CUDA graphs. Grouped-query attention: torch >= 2.12
    takes `enable_gqa`; on 2.11 the FlashAttention kernel is first tried with the smaller
    K/V head count (no copy), and only if torch rejects that are K/V heads repeated.
    """

    name = "varlen"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import varlen_attn

        self._attn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        self._has_enable_gqa = "enable_gqa" in params
        self._has_window = "window_size" in params
        self._has_is_causal = "is_causal" in params
        self._gqa_native: bool | None = True if self._has_enable_gqa else None

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              gqa: bool) -> torch.Tensor:
        kwargs: dict = {}
        if meta.causal:
            if self._has_window:
                kwargs["window_size"] = (-1, 0)
            elif self._has_is_causal:
                kwargs["is_causal"] = True
            else:
                raise RuntimeError("this torch's varlen_attn has no causal option")
        if gqa and self._has_enable_gqa:
            kwargs["enable_gqa"] = True
        cu = meta.cu_seqlens
        return self._attn(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, **kwargs)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups == 1:
            return self._call(q, k, v, meta, gqa=False)
        if self._gqa_native is None:
            # Decided on the first (eager, never captured) step of the model.
            try:
                out = self._call(q, k, v, meta, gqa=True)
                self._gqa_native = True
                return out
            except RuntimeError as exc:
                log.info("varlen_attn rejects grouped K/V heads (%s); repeating K/V heads", exc)
                self._gqa_native = False
        if self._gqa_native:
            return self._call(q, k, v, meta, gqa=True)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return self._call(q, k, v, meta, gqa=False)
