"""Pooling of packed token states into one float32 vector per sequence slot, without host syncs.

All three modes use only gathers, scatters and elementwise ops whose shapes depend on
tensor shapes (T, B, hidden size), never on tensor values, so they can be captured in
a CUDA graph. Zero-length slots pool to zeros; tokens whose ``seq_ids`` entry is B
(bucket padding) are ignored.
"""

from __future__ import annotations

import torch

from core_engine.attention.base import AttentionMetadata


def mean_pool(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Mean of each slot's token states: [T, H] -> [B, H] float32."""
    b = meta.num_seqs
    sums = torch.zeros(b + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, meta.seq_ids, hidden.float())
    lens = meta.seq_lens.to(torch.float32).clamp(min=1.0)
    return sums[:b] / lens[:, None]


def pooled_rows(meta: AttentionMetadata, num_tokens: int, mode: str) -> torch.Tensor | None:
    """The token row each slot pools, int64 [B] clamped into [0, T); None for "mean", which reads every row.

    A model can pass these rows to its last layer, which then runs its per-row work
    (projection after attention, norms, MLP) on B rows instead of T: the result is the
    same, since every other row would be dropped by pooling anyway.
    """
    if mode == "mean":
        return None
    index = meta.cu_seqlens[:-1] if mode == "cls" else meta.cu_seqlens[1:] - 1
    return index.long().clamp(0, max(num_tokens - 1, 0))


def pools_early(mode: str, enabled: bool = True) -> bool:
    """Whether a model pooling with ``mode`` runs its last layer on ``pooled_rows`` only.

    It does for "cls" and "last" unless `enabled` is False (KernelOptions.pool_early: every
    row through the last layer, then pooling; the same vectors, for measuring what the shortcut saves).
    """
    return mode != "mean" and enabled


def pool_picked(picked: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The states of ``pooled_rows`` [B, H] as float32, zeros for empty slots."""
    nonempty = (meta.cu_seqlens[1:] > meta.cu_seqlens[:-1])[:, None]
    # where(), not multiply: a clamped index may land on a padding row holding NaN.
    return torch.where(nonempty, picked.float(), torch.zeros((), dtype=torch.float32, device=picked.device))


def cls_pool(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each slot's first token state: [T, H] -> [B, H] float32."""
    return pool_picked(hidden.index_select(0, pooled_rows(meta, hidden.shape[0], "cls")), meta)


def last_pool(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each slot's last token state: [T, H] -> [B, H] float32."""
    return pool_picked(hidden.index_select(0, pooled_rows(meta, hidden.shape[0], "last")), meta)


POOLERS = {"mean": mean_pool, "cls": cls_pool, "last": last_pool}


class Pooler:
    """A model's pooling, and whether its last layer runs on the pooled rows only (`pools_early`).

    The model asks `rows(meta, T)` for the rows to keep after its last attention (None: all
    of them) and calls the pooler on that layer's output, whichever rows it holds.
    """

    def __init__(self, mode: str, layers: int, early: bool = True) -> None:
        self.mode, self.pool = mode, POOLERS[mode]
        self.early = layers > 0 and pools_early(mode, early)

    def rows(self, meta: AttentionMetadata, num_tokens: int) -> torch.Tensor | None:
        """``pooled_rows`` when the last layer keeps only those, else None."""
        return pooled_rows(meta, num_tokens, self.mode) if self.early else None

    def __call__(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T, H] (or [B, H] of ``rows``, when the last layer kept only those) -> [B, H] float32."""
        return pool_picked(hidden, meta) if self.early else self.pool(hidden, meta)


def pool(hidden: torch.Tensor, meta: AttentionMetadata, mode: str) -> torch.Tensor:
    """Pool packed ``hidden`` [T, H] per slot with ``mode`` ("mean" | "cls" | "last")."""
    if mode not in POOLERS:
        raise ValueError(f"pooling {mode!r} is not one of {sorted(POOLERS)}")
    return POOLERS[mode](hidden, meta)
