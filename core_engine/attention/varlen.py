"""Packed attention on CUDA through torch's `varlen_attn` (FlashAttention-2 varlen), graph-capturable."""

from __future__ import annotations

import inspect
import logging

import torch

from core_engine.attention.base import AttentionMetadata

log = logging.getLogger(__name__)


class VarlenAttention:
    """FlashAttention-2 varlen over the packed batch, as `varlen_attn` runs it; the CUDA default.

    Everything it needs is on the device (cu_seqlens) or a host int fixed per graph key
    (max_seqlen), so it records into CUDA graphs. It calls the op that
    `torch.nn.attention.varlen.varlen_attn` wraps, `aten._flash_attention_forward`, directly:
    the wrapper also fills a zero rng-state tensor on the device at every call (dropout is
    off), one more kernel and graph node per layer, 24-28 of them in every batch-1 step.
    Measured on an H200 (one run, same weights, identical vectors): a 128-token step's graph
    replay went 1.15 -> 1.00 ms (BGE-M3 shape, 199 -> 175 kernels) and 1.48 -> 1.43 ms
    (pplx-0.6b shape); `benchmarks/results/varlen-direct-h200-stop12.json`.
    That op takes fewer K/V heads than query heads as they are (grouped-query attention, no
    copy). Where it is missing, `varlen_attn` serves: torch >= 2.12 takes `enable_gqa`; on
    2.11 the kernel is first tried with the smaller K/V head count, and only if torch
    rejects that are K/V heads repeated.
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
        self._flash = getattr(torch.ops.aten, "_flash_attention_forward", None)

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
        if self._flash is not None:
            cu = meta.cu_seqlens
            # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            # return_debug_mask) -> (output, logsumexp, rng_state, unused, debug_attn_mask)
            return self._flash(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, 0.0, meta.causal, False)[0]
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
