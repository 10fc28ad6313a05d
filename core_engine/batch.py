"""Packing of token-id sequences into one step's flat int64 buffer, and the model inputs read from it.

Layout for graph key (T tokens, S slots): input_ids[T] | positions[T] | seq_ids[T] |
cu_seqlens[S + 1] | seq_lens[S]. Sequences lie end to end with no padding between them;
positions are 0-based within each. When the key has more tokens than the sequences, the
bucket padding forms the last slot, a real (discarded) sequence of token 0, so every token
belongs to a slot and every row the model computes is finite. Slots between the sequences
and that last one are empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from core_engine.attention.base import AttentionMetadata
from core_engine.graphs import GraphKey

# Up to this many sequences, a batch is packed one slice assignment per sequence and region;
# larger ones with numpy's whole-array operations. A query (one sequence) is the case that
# matters: its packing is on the path of every online request, where the dozen whole-array
# calls cost more in per-call overhead than the few slices (about even at 4-8 sequences,
# whole-array ahead from 16).
SLICED_PACK_SEQS = 2


def packed_size(tokens: int, slots: int) -> int:
    """int64 entries of the packed buffer for a key of `tokens` tokens and `slots` slots."""
    return 3 * tokens + 2 * slots + 1


def regions(buf: torch.Tensor | np.ndarray, key: GraphKey) -> tuple:
    """input_ids, positions, seq_ids, cu_seqlens, seq_lens: views into a packed buffer (torch or numpy).

    The one place the layout is written down in code.
    """
    t, s = key.tokens, key.slots
    return buf[:t], buf[t: 2 * t], buf[2 * t: 3 * t], buf[3 * t: 3 * t + s + 1], buf[3 * t + s + 1: 3 * t + 2 * s + 1]


def _upto(ramp: np.ndarray, n: int) -> np.ndarray:
    """0..n-1 (int64): a view of `ramp` (0, 1, 2, ...) when it is long enough, else a new range."""
    return ramp[:n] if n <= len(ramp) else np.arange(n, dtype=np.int64)


def pack_into(buf: np.ndarray, key: GraphKey, sequences: Sequence[Sequence[int]], lengths: list[int],
              total: int, ramp: np.ndarray, *, sliced: bool | None = None) -> np.ndarray:
    """Fill a packed buffer for `key` with `sequences` (their `lengths`, `total` tokens); returns its cu_seqlens.

    The engine's packer, unchecked: `key` must hold the sequences (int lists or integer arrays),
    with a slot to spare when it has more tokens than they do. `ramp` is 0, 1, 2, ... (int64);
    positions are slices of it instead of a new range per call. `sliced` picks the per-sequence
    or the whole-array way (default: by SLICED_PACK_SEQS); both write the same buffer.
    """
    ids, pos, sid, cu, lens = regions(buf, key)
    num_seqs, tokens, slots = len(lengths), key.tokens, key.slots
    if sliced is None:
        sliced = num_seqs <= SLICED_PACK_SEQS
    cu[0] = 0
    if sliced:
        start = 0
        for i, (seq, length) in enumerate(zip(sequences, lengths)):
            end = start + length
            ids[start:end] = seq
            pos[start:end] = _upto(ramp, length)  # 0-based: the model applies XLM-R's offset itself
            sid[start:end] = i
            cu[i + 1] = end
            start = end
        lens[:num_seqs] = lengths
    else:
        counts = np.asarray(lengths, dtype=np.int64)
        if any(isinstance(seq, np.ndarray) for seq in sequences):
            # A worker process's int32 ids: one copy into the buffer (fromiter would box every id).
            np.concatenate([seq if isinstance(seq, np.ndarray) else np.asarray(seq, dtype=np.int64)
                            for seq in sequences], out=ids[:total])
        else:
            ids[:total] = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=total)
        np.cumsum(counts, out=cu[1: num_seqs + 1])
        pos[:total] = _upto(ramp, total) - np.repeat(cu[:num_seqs], counts)
        sid[:total] = np.repeat(_upto(ramp, num_seqs), counts)
        lens[:num_seqs] = counts
    if slots > num_seqs:
        # Unused slots are empty; the last slot holds the bucket padding, a real (discarded)
        # sequence of token 0, so attention and pooling see only finite, in-range rows.
        pad = tokens - total
        cu[num_seqs + 1: slots] = total
        cu[slots] = tokens
        lens[num_seqs: slots - 1] = 0
        lens[slots - 1] = pad
        ids[total:] = 0
        pos[total:] = _upto(ramp, pad)
        sid[total:] = slots - 1
    return cu


def pack(sequences: Sequence[Sequence[int]], key: GraphKey | None = None) -> tuple[torch.Tensor, GraphKey]:
    """`sequences` packed by `pack_into` into a new host buffer, with the key it was packed for.

    Without `key`, the exact one: every token real, one slot per sequence. With a key (a graph
    bucket, `graphs.key_for`), its padding as the engine pads. Zero-length sequences make empty
    slots. Errors name the input that does not fit.
    """
    lengths = [len(s) for s in sequences]
    if not lengths:
        raise ValueError("sequences: empty batch")
    total = sum(lengths)
    if key is None:
        key = GraphKey(tokens=total, slots=len(lengths), max_seqlen=max(lengths))
    if key.slots < len(lengths) or key.tokens < total:
        raise ValueError(f"key {key} is too small for {len(lengths)} sequences of {total} tokens")
    if key.tokens > total and key.slots == len(lengths):
        raise ValueError(f"key {key} pads {key.tokens - total} tokens but has no slot to spare for them")
    buf = torch.empty(packed_size(key.tokens, key.slots), dtype=torch.int64)
    pack_into(buf.numpy(), key, sequences, lengths, total, np.arange(key.tokens, dtype=np.int64))
    return buf, key


def model_inputs(buf: torch.Tensor, key: GraphKey, causal: bool,
                 cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta), the model's forward arguments, as views of a packed buffer on its device.

    `cu_seqlens_cpu` is the host int32 copy of cu_seqlens that planning backends read; on the
    CPU it is taken from the buffer when not given.
    """
    input_ids, positions, seq_ids, cu_seqlens, seq_lens = regions(buf, key)
    if cu_seqlens_cpu is None and buf.device.type == "cpu":
        cu_seqlens_cpu = cu_seqlens.to(torch.int32)
    meta = AttentionMetadata(
        cu_seqlens=cu_seqlens.to(torch.int32),
        max_seqlen=key.max_seqlen,
        seq_ids=seq_ids,
        seq_lens=seq_lens,
        causal=causal,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return input_ids, positions, meta
