"""Packing of token-id sequences into one flat batch: input_ids, 0-based positions and AttentionMetadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core_engine.attention.base import AttentionMetadata


@dataclass
class PackedBatch:
    """Sequences laid end to end with no padding between them, ready for ``model(...)``."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], 0-based within each sequence
    meta: AttentionMetadata

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, meta), the model's forward arguments."""
        return self.input_ids, self.positions, self.meta


def pack(
    sequences: Sequence[Sequence[int]],
    *,
    causal: bool,
    device: torch.device | str = "cpu",
    num_tokens: int | None = None,
    num_slots: int | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack ``sequences`` of token ids; optionally pad to ``num_tokens`` tokens and ``num_slots`` slots.

    Padding (for fixed-shape CUDA graphs) adds tokens after the last sequence that belong
    to no slot (``seq_ids == num_slots``, position 0, id ``pad_token_id``) and empty slots
    after the last sequence. Built on the host with numpy, then copied once per tensor.
    """
    lens = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    total = int(lens.sum())
    slots = len(sequences) if num_slots is None else num_slots
    tokens = total if num_tokens is None else num_tokens
    if slots < len(sequences):
        raise ValueError(f"num_slots={slots} is smaller than the {len(sequences)} sequences")
    if tokens < total:
        raise ValueError(f"num_tokens={tokens} is smaller than the {total} tokens of the sequences")

    ids = np.full(tokens, pad_token_id, dtype=np.int64)
    if total:
        ids[:total] = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences if len(s)])
    slot_lens = np.zeros(slots, dtype=np.int64)
    slot_lens[: len(sequences)] = lens
    cu = np.zeros(slots + 1, dtype=np.int32)
    np.cumsum(slot_lens, out=cu[1:])
    seq_ids = np.full(tokens, slots, dtype=np.int64)
    seq_ids[:total] = np.repeat(np.arange(len(sequences), dtype=np.int64), lens)
    positions = np.zeros(tokens, dtype=np.int64)
    positions[:total] = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1][: len(sequences)].astype(np.int64), lens)

    cu_cpu = torch.from_numpy(cu)
    meta = AttentionMetadata(
        cu_seqlens=cu_cpu.to(device),
        max_seqlen=int(lens.max()) if len(lens) else 0,
        seq_ids=torch.from_numpy(seq_ids).to(device),
        seq_lens=torch.from_numpy(slot_lens).to(device),
        causal=causal,
        cu_seqlens_cpu=cu_cpu,
    )
    return PackedBatch(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device), meta)
