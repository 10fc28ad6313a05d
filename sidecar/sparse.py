"""BM25-style sparse lexical vectors over the model's own token ids, for hybrid search.

A text's sparse vector has one entry per distinct (non-special) token id it contains;
the value is BM25's saturated term frequency

    tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / avgdl))

where `tf` counts the token in the text and `len` is the text's token count (special
tokens excluded). The inverse document frequency is left to the database, which knows
its corpus: Qdrant's ``Modifier.IDF`` on the sparse vector, or a weighting on the
Postgres side. The defaults are the usual BM25 constants, and those of Qdrant's own
FastEmbed BM25 (k1 = 1.2, b = 0.75, avgdl = 256 tokens).

The gateway builds sparse vectors from the input text *without* the prompt template
(a "query: " prefix on every query would match every document) and *without*
truncation at the model's limit: a long document keeps the terms of its first
SPARSE_MAX_TOKENS tokens (sidecar/tokenize/windows.py; 8,192), which bounds what one huge
text costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

K1 = 1.2
B = 0.75
AVGDL = 256.0


@dataclass(frozen=True)
class SparseParams:
    """The BM25 constants: term-frequency saturation `k1`, length normalization `b`,
    and the assumed average document length `avgdl` in tokens."""

    k1: float = K1
    b: float = B
    avgdl: float = AVGDL


def sparse_vector(ids: Sequence[int], special_ids: Iterable[int] = (),
                  params: SparseParams = SparseParams()) -> tuple[np.ndarray, np.ndarray]:
    """The sparse vector of one token sequence: (indices uint32 sorted ascending, values float32)."""
    tokens = np.asarray(ids, dtype=np.int64)
    special = np.fromiter(special_ids, dtype=np.int64)
    if special.size and tokens.size:
        tokens = tokens[~np.isin(tokens, special)]
    if tokens.size == 0:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.float32)
    indices, tf = np.unique(tokens, return_counts=True)
    tf = tf.astype(np.float64)
    norm = params.k1 * (1.0 - params.b + params.b * tokens.size / params.avgdl)
    values = tf * (params.k1 + 1.0) / (tf + norm)
    return indices.astype(np.uint32), values.astype(np.float32)
