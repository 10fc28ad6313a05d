"""Packed attention through FlashInfer's ragged prefill kernels, planned on the host when a batch is prepared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core_engine.attention.base import AttentionMetadata, AttentionShape
from core_engine.graphs import GraphKey

WORKSPACE_BYTES = 128 << 20


def workspace_bytes(shape: AttentionShape, max_tokens: int) -> int:
    """Scratch space for steps of up to `max_tokens`: at least WORKSPACE_BYTES, more for big steps.

    The prefill kernels may split sequences and keep float32 partial outputs for every
    token and head: a 65,536-token BGE-M3 step asked for 200 MB (and failed in 128 MB).
    """
    partials = max_tokens * shape.num_qo_heads * (shape.head_dim + 2) * 4
    return max(WORKSPACE_BYTES, partials + (32 << 20))


def default_kernel(device: torch.device, shape: AttentionShape) -> str:
    """FlashInfer's kernel family: fa3 on Hopper where it compiles (head_dim 64, 128, 256), else fa2.

    On Hopper, with its host plan overlapping the previous step, fa3 on strided Q/K/V beats
    varlen on mid-sized steps where fa2 does not; the engine still picks the backend per shape
    by measurement.
    """
    hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return "fa3" if hopper and shape.head_dim in (64, 128, 256) else "fa2"


@dataclass(eq=False)
class _Wrapper:
    """One FlashInfer wrapper and what the host knows about it."""

    wrapper: Any
    copied: "torch.cuda.Event | None"  # recorded after the last plan's pinned-buffer copy was queued (CUDA only)
    last_plan: "FlashInferPlan | None" = None  # the plan its next run computes


@dataclass(frozen=True, eq=False)
class FlashInferPlan:
    """One batch's plan: its graph key, graph or eager, and the wrapper it was made on (which must run it)."""

    key: GraphKey
    for_graph: bool
    on: _Wrapper


class FlashInferAttention:
    """`BatchPrefillWithRaggedKVCacheWrapper` (no KV cache; causal or not) behind the backend protocol.

    FlashInfer splits work on the host: `plan()` reads the CPU int32 `cu_seqlens` and fills
    the wrapper's index buffers, `run()` launches the kernel. The engine plans each batch when
    it prepares it (while the previous step runs) and runs it later, possibly after other
    batches were planned: `holds(plan)` tells whether the wrapper still holds a batch's plan,
    `use(plan)` makes its wrapper the one the next call runs. Only `run()` is recorded in a
    graph. A graph-mode wrapper has a fixed slot count and may never be planned for more
    tokens than at its first plan, so each graph key owns one wrapper (released with the
    graph); eager steps share one ordinary wrapper. Grouped-query attention is native.
    `kernel` ("fa2", "fa3") and `contiguous` (Q/K/V made contiguous) default by device and kernel.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, shape: AttentionShape, causal: bool,
                 dtype: torch.dtype = torch.bfloat16, max_tokens: int = 16384, kernel: str | None = None,
                 contiguous: bool | None = None) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.device = device
        self.shape = shape
        self.causal = causal
        self.dtype = dtype
        self.kernel = kernel or default_kernel(device, shape)
        self.contiguous = self.kernel != "fa3" if contiguous is None else contiguous
        self._workspace = torch.empty(workspace_bytes(shape, max_tokens), dtype=torch.uint8, device=device)
        self._eager = self._new_wrapper()
        self._graph_wrappers: dict[GraphKey, _Wrapper] = {}
        self._active: Any = None

    def _new_wrapper(self, **graph_buffers: Any) -> _Wrapper:
        wrapper = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace, "NHD", backend=self.kernel, **graph_buffers)
        return _Wrapper(wrapper, torch.cuda.Event() if self.device.type == "cuda" else None)

    def _wrapper(self, key: GraphKey, for_graph: bool, create: bool) -> _Wrapper | None:
        """The wrapper steps of `key` run in this mode: the eager one, or the key's own graph wrapper."""
        if not for_graph:
            return self._eager
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None and create:
            indptr = torch.empty(key.slots + 1, dtype=torch.int32, device=self.device)
            wrapper = self._new_wrapper(use_cuda_graph=True, qo_indptr_buf=indptr, kv_indptr_buf=indptr.clone())
            self._graph_wrappers[key] = wrapper
        return wrapper

    def plan(self, key: GraphKey, cu_seqlens_cpu: torch.Tensor, for_graph: bool) -> FlashInferPlan:
        """Plan a batch on the host (CPU int32 indptr) and make it the one the next call runs."""
        on = self._wrapper(key, for_graph, create=True)
        # FlashInfer's plan writes the plan into the wrapper's pinned host buffer, queues a
        # cudaMemcpyAsync from it to the device on the current stream and returns
        # (include/flashinfer/attention/scheduler.cuh: PrefillPlanImpl for fa2, PrefillSM90Plan
        # for fa3). The DMA reads the pinned buffer only when the copy's turn on the stream
        # comes, and a plan made in prepare() is queued behind the step still running. A second
        # plan of the same wrapper before then would overwrite the buffer, and the first batch
        # would run with the second batch's plan. So the host waits for the last copy from this
        # wrapper first; usually it ran long ago, before the step it was planned for.
        if on.copied is not None:
            on.copied.synchronize()
        s = self.shape
        on.wrapper.plan(cu_seqlens_cpu, cu_seqlens_cpu, s.num_qo_heads, s.num_kv_heads, s.head_dim,
                        causal=self.causal, q_data_type=self.dtype, kv_data_type=self.dtype)
        if on.copied is not None:
            on.copied.record(torch.cuda.current_stream(self.device))
        plan = FlashInferPlan(key=key, for_graph=for_graph, on=on)
        on.last_plan = plan
        self._active = on.wrapper
        return plan

    def holds(self, plan: FlashInferPlan) -> bool:
        """Whether running `plan` now computes its batch: its wrapper is still the one for its key and
        mode (not evicted and re-made) and nothing planned that wrapper since."""
        return self._wrapper(plan.key, plan.for_graph, create=False) is plan.on and plan.on.last_plan is plan

    def use(self, plan: FlashInferPlan) -> None:
        """Make the wrapper `plan` was made on the one the next call runs."""
        self._active = plan.on.wrapper

    def release(self, key: GraphKey) -> None:
        """Drop the graph wrapper of `key`: its graph was evicted, or its capture failed (eager from then on)."""
        released = self._graph_wrappers.pop(key, None)
        # Once the wrapper is freed, torch's pinned-memory cache may hand its host buffer to the
        # next wrapper made. The plan's cudaMemcpyAsync from that buffer recorded no event with
        # the cache (it is FlashInfer's, not a torch copy), so wait here for it to have run; after
        # a failed capture it was queued just before, for the step now running that key eagerly.
        if released is not None and released.copied is not None:
            released.copied.synchronize()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if self._active is None:
            raise RuntimeError("FlashInferAttention called before plan()")
        # Contiguous Q/K/V: a strided view once crashed the kernel ("operation not supported
        # on global/shared address space", GPU-NOTES).
        if self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return self._active.run(q, k, v)
