"""A step's token-head outputs on the host, cut per text, and BGE-M3's learned sparse reduction (numpy only).

The engine copies the rows of a step's real tokens from the heads (core_engine.heads) into
one [T, width] float32 array: column 0 the learned sparse weight when the model has a
sparse head, then the L2-normalized ColBERT vector when it has a ColBERT head.
`TokenOutputs.rows(i)` cuts text i's rows out of it; `learned_sparse` turns one text's
weights into its sparse vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenRows:
    """One text's head outputs: `weights` [L] per input token (None: no sparse head),
    `multivector` [L - 1, dim] for every token after CLS (None: no ColBERT head)."""

    weights: np.ndarray | None
    multivector: np.ndarray | None


@dataclass(frozen=True)
class TokenOutputs:
    """A step's head outputs on the host: `values` [T_real, width] float32 and `cu_seqlens` [B + 1] of its texts."""

    values: np.ndarray
    cu_seqlens: np.ndarray
    sparse: bool

    def rows(self, i: int) -> TokenRows:
        """Text ``i``'s rows (views into `values`)."""
        start, end = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        weights = self.values[start:end, 0] if self.sparse else None
        first = 1 if self.sparse else 0
        multivector = self.values[start + 1:end, first:] if self.values.shape[1] > first else None
        return TokenRows(weights, multivector)


@dataclass(frozen=True)
class StepResult:
    """What a step that asked for token outputs yields: pooled [B, D] and the head outputs of its B texts."""

    pooled: np.ndarray
    tokens: TokenOutputs


def learned_sparse(ids: np.ndarray | list[int], weights: np.ndarray,
                   unused: frozenset[int] | tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """One text's learned sparse vector: (token ids uint32 ascending, their largest weight float32).

    Tokens in ``unused`` (cls, eos, pad, unk) and weights <= 0 are left out.
    """
    tokens = np.asarray(ids, dtype=np.int64)
    values = np.asarray(weights, dtype=np.float32)
    if tokens.shape != values.shape:
        raise ValueError(f"learned_sparse: {tokens.size} token ids but {values.size} weights")
    keep = values > 0
    if unused:
        keep &= ~np.isin(tokens, np.fromiter(unused, dtype=np.int64))
    tokens, values = tokens[keep], values[keep]
    if tokens.size == 0:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.float32)
    order = np.argsort(tokens, kind="stable")
    tokens, values = tokens[order], values[order]
    starts = np.flatnonzero(np.r_[True, tokens[1:] != tokens[:-1]])
    return tokens[starts].astype(np.uint32), np.maximum.reduceat(values, starts).astype(np.float32)
