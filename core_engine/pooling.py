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


def _pick(hidden: torch.Tensor, meta: AttentionMetadata, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` [B] of ``hidden`` as float32, zeros for empty slots."""
    t = hidden.shape[0]
    picked = hidden.index_select(0, index.long().clamp(0, max(t - 1, 0))).float()
    nonempty = (meta.cu_seqlens[1:] > meta.cu_seqlens[:-1])[:, None]
    # where(), not multiply: a clamped index may land on a padding row holding NaN.
    return torch.where(nonempty, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def cls_pool(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each slot's first token state: [T, H] -> [B, H] float32."""
    return _pick(hidden, meta, meta.cu_seqlens[:-1])


def last_pool(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each slot's last token state: [T, H] -> [B, H] float32."""
    return _pick(hidden, meta, meta.cu_seqlens[1:] - 1)


POOLERS = {"mean": mean_pool, "cls": cls_pool, "last": last_pool}


def pool(hidden: torch.Tensor, meta: AttentionMetadata, mode: str) -> torch.Tensor:
    """Pool packed ``hidden`` [T, H] per slot with ``mode`` ("mean" | "cls" | "last")."""
    if mode not in POOLERS:
        raise ValueError(f"pooling {mode!r} is not one of {sorted(POOLERS)}")
    return POOLERS[mode](hidden, meta)
