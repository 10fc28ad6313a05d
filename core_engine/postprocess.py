"""Turns raw pooled vectors into what a client asked for: Matryoshka truncation, L2 norm, wire encoding.

The order is fixed: truncate to ``dimensions`` first, then normalize (a truncated
Matryoshka vector is re-normalized, as sentence-transformers' ``truncate_dim`` +
``normalize_embeddings`` do), then encode:

- ``float32`` / ``float16``: little-endian ``<f4`` / ``<f2``.
- ``int8``: models with native int8 (pplx-embed) use ``round(127 * tanh(x))``; others
  scale each vector by its own largest magnitude, ``round(127 * x / max|x|)`` (an all-zero
  vector stays zero). ``x`` is the vector after truncation and normalization.
- ``binary``: one bit per dimension, ``x > 0``, packed big-bit-first with
  ``np.packbits`` into ``ceil(dims / 8)`` uint8 per vector.
"""

from __future__ import annotations

import numpy as np

ENCODINGS = ("float32", "float16", "int8", "binary")


if hasattr(np, "vecdot"):  # numpy >= 2

    def _squared_norms(x: np.ndarray) -> np.ndarray:
        """Each row's dot product with itself, in one C call."""
        return np.vecdot(x, x)

else:

    def _squared_norms(x: np.ndarray) -> np.ndarray:
        """Each row's dot product with itself."""
        return np.einsum("ij,ij->i", x, x)


def _rows_int8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), -127, 127).astype(np.int8)


def finalize(
    pooled: np.ndarray, *, dimensions: int, normalize: bool, encoding: str, native_int8: bool
) -> np.ndarray:
    """Truncate ``pooled`` [B, D] to ``dimensions`` (0 = all D), optionally L2-normalize, then encode."""
    x = np.asarray(pooled)
    if x.ndim != 2:
        raise ValueError(f"pooled must be a 2-D array [vectors, dims], got shape {x.shape}")
    full = x.shape[1]
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)):
        raise TypeError(f"dimensions must be an int, got {type(dimensions).__name__}")
    if not 0 <= dimensions <= full:
        raise ValueError(f"dimensions={dimensions} is out of range: use 1..{full}, or 0 for all {full}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")

    # A query's vector is finalized on the event loop, on caches cold from waiting on the
    # engine, where each numpy call costs several microseconds: as few calls as possible.
    # The result never shares memory with `pooled`.
    x = x[:, : dimensions or full].astype(np.float32, copy=not normalize)
    if normalize:
        x = x / np.maximum(np.sqrt(_squared_norms(x)), 1e-12)[:, None]

    if encoding == "float32":
        return x.astype("<f4", copy=False)
    if encoding == "float16":
        return x.astype("<f2")
    if encoding == "binary":
        return np.packbits(x > 0, axis=1)
    if native_int8:
        return _rows_int8(127.0 * np.tanh(x))
    peak = np.abs(x).max(axis=1, keepdims=True)
    scale = np.divide(127.0, peak, out=np.zeros_like(peak), where=peak > 0)
    return _rows_int8(x * scale)
