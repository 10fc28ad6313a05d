"""The packed-attention contract: per-batch metadata and the backend protocol every kernel implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from core_engine.graphs import GraphKey


@dataclass
class AttentionMetadata:
    """Describes one packed batch of B sequence slots laid end to end in T tokens.

    Sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``; there is no padding
    between sequences. Zero-length slots are allowed (CUDA-graph padding) and pool to
    zeros. Tokens past ``cu_seqlens[-1]`` (bucket padding) belong to no sequence: their
    ``seq_ids`` entry must be ``B`` so pooling drops them, and backends never read them.
    """

    cu_seqlens: torch.Tensor  # int32 [B + 1] on the model's device
    max_seqlen: int  # upper bound on any slot's length (host int, part of a graph key)
    seq_ids: torch.Tensor  # int64 [T] slot of each token, B for bucket-padding tokens
    seq_lens: torch.Tensor  # [B] slot lengths (int or float) on the model's device
    causal: bool  # True: token i attends to tokens <= i of its own sequence only
    # Optional host (CPU int32) copy of cu_seqlens. Backends that plan on the host
    # (the per-sequence CPU path, FlashInfer's plan()) use it instead of reading the
    # device tensor back, which would be a host sync.
    cu_seqlens_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """Number of sequence slots B (a shape, so no device read)."""
        return self.cu_seqlens.shape[0] - 1


@dataclass(frozen=True)
class AttentionShape:
    """Head layout of a model, read from its config.json."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class AttentionBackend(Protocol):
    """Packed variable-length attention with softmax scale 1/sqrt(head_dim).

    ``q`` is [T, Hq, D]; ``k`` and ``v`` are [T, Hkv, D] with Hq a multiple of Hkv
    (grouped-query attention: query head h reads kv head h // (Hq // Hkv)). Returns
    [T, Hq, D] in q's dtype. Attention never crosses a sequence boundary; ``meta.causal``
    restricts it further to earlier tokens of the same sequence. Rows for tokens that
    belong to no sequence may hold anything (they are dropped by pooling).

    q, k and v are usually views into a fused projection's output: the last dimension is
    contiguous, the token and head strides are not. A backend whose kernel needs dense
    inputs calls ``.contiguous()`` itself.
    """

    name: str

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


@runtime_checkable
class PlanningBackend(AttentionBackend, Protocol):
    """A backend with host-side work per batch (FlashInfer), done apart from the kernel launch.

    ``plan`` prepares one batch of graph key ``key`` (CPU int32 ``cu_seqlens_cpu``) for a
    graph step or an eager one and makes that plan the one the next call runs; it returns
    the backend's record of the plan. The engine plans when it prepares a batch, while the
    previous step runs, and the step may come later, after other batches were planned: so
    ``holds(plan)`` says whether running ``plan`` now would still compute that batch (nothing
    re-planned its state since, and it is still the state a step of its key and mode uses),
    and ``use(plan)`` makes it the one the next call runs. ``release(key)`` drops what was
    kept for a graph key whose graph was evicted, or whose capture failed.
    """

    def plan(self, key: GraphKey, cu_seqlens_cpu: torch.Tensor, for_graph: bool) -> Any: ...

    def holds(self, plan: Any) -> bool: ...

    def use(self, plan: Any) -> None: ...

    def release(self, key: GraphKey) -> None: ...


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The attention side of one prepared batch: the backend that runs it, graph or eager, and its plan.

    It travels with the batch from ``prepare()`` to ``step()``, so a step runs with its own
    plan whatever was planned in between. ``state`` is the backend's record of the plan
    (``PlanningBackend.plan``'s result), None for backends with nothing to plan.
    """

    backend: str
    for_graph: bool
    state: Any = None
