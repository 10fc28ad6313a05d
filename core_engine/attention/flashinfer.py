"""Packed attention through FlashInfer's ragged prefill kernels, planned on the host once per step."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from core_engine.attention.base import AttentionMetadata
from core_engine.graphs import GraphKey

if TYPE_CHECKING:
    from core_engine.attention.select import AttentionShape

WORKSPACE_BYTES = 128 << 20


def workspace_bytes(shape: "AttentionShape", max_tokens: int) -> int:
    """Scratch space for steps of up to `max_tokens`: at least WORKSPACE_BYTES, more for big steps.

    The prefill kernels may split sequences and keep float32 partial outputs for every
    token and head: a 65,536-token BGE-M3 step asked for 200 MB (and failed in 128 MB).
    """
    partials = max_tokens * shape.num_qo_heads * (shape.head_dim + 2) * 4
    return max(WORKSPACE_BYTES, partials + (32 << 20))


class FlashInferAttention:
    """`BatchPrefillWithRaggedKVCacheWrapper` (no KV cache; causal or not) behind the backend protocol.

    FlashInfer splits work on the host: `plan()` reads the CPU int32 `cu_seqlens` and fills
    the wrapper's index buffers, `run()` launches the kernel. The engine calls `plan()` before
    every step (so once per graph replay at most) and only `run()` is recorded in a graph.
    A graph-mode wrapper has a fixed slot count and may never be planned for more tokens
    than at its first plan, so each captured graph key owns one wrapper (released with the
    graph); eager steps share one ordinary wrapper. Grouped-query attention is native.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, shape: "AttentionShape", causal: bool,
                 dtype: torch.dtype = torch.bfloat16, max_tokens: int = 16384) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.device = device
        self.shape = shape
        self.causal = causal
        self.dtype = dtype
        self.kernel = os.environ.get("FERN_FLASHINFER_BACKEND", "fa2")
        self.contiguous = os.environ.get("FERN_FLASHINFER_CONTIGUOUS", "1") != "0"
        self._workspace = torch.empty(workspace_bytes(shape, max_tokens), dtype=torch.uint8, device=device)
        self._eager = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD", backend=self.kernel)
        self._graph_wrappers: dict[GraphKey, object] = {}
        self._active: object | None = None

    def _graph_wrapper(self, key: GraphKey) -> object:
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None:
            indptr = torch.empty(key.slots + 1, dtype=torch.int32, device=self.device)
            wrapper = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=indptr,
                kv_indptr_buf=indptr.clone(), backend=self.kernel)
            self._graph_wrappers[key] = wrapper
        return wrapper

    def plan(self, key: GraphKey, cu_seqlens_cpu: torch.Tensor, for_graph: bool) -> None:
        """Plan the next step on the host (CPU int32 indptr); graph steps use the key's own wrapper."""
        wrapper = self._graph_wrapper(key) if for_graph else self._eager
        s = self.shape
        wrapper.plan(cu_seqlens_cpu, cu_seqlens_cpu, s.num_qo_heads, s.num_kv_heads, s.head_dim,
                     causal=self.causal, q_data_type=self.dtype, kv_data_type=self.dtype)
        self._active = wrapper

    def release(self, key: GraphKey) -> None:
        """Drop the wrapper of an evicted graph."""
        self._graph_wrappers.pop(key, None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if self._active is None:
            raise RuntimeError("FlashInferAttention called before plan()")
        # Contiguous Q/K/V: a strided view once crashed the kernel ("operation not supported
        # on global/shared address space", GPU-NOTES).
        if self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return self._active.run(q, k, v)
