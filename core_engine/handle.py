"""EmbeddingHandle, Fern's LazyTensor: a step's pooled vectors arriving in pinned host memory behind a CUDA event."""

from __future__ import annotations

import numpy as np
import torch


class EmbeddingHandle:
    """The pending result of one `Engine.step()`.

    On CUDA the pooled rows are copied into a pinned host buffer with a non-blocking copy and a
    CUDA event is recorded after it, so `step()` returns before the GPU has finished; `done()`
    polls the event and `result()` waits on it. On the CPU the buffer is already filled.
    """

    __slots__ = ("_host", "_event", "_rows")

    def __init__(self, host: torch.Tensor, rows: int, event: "torch.cuda.Event | None" = None) -> None:
        self._host = host
        self._rows = rows
        self._event = event

    @classmethod
    def from_device(cls, pooled: torch.Tensor, rows: int) -> "EmbeddingHandle":
        """Start the asynchronous copy of `pooled[:rows]` (float32, on CUDA) into pinned memory."""
        host = torch.empty((rows, pooled.shape[1]), dtype=torch.float32, pin_memory=True)
        host.copy_(pooled[:rows], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, rows, event)

    @classmethod
    def ready(cls, pooled: torch.Tensor, rows: int) -> "EmbeddingHandle":
        """A handle for a CPU step whose result is already computed."""
        return cls(pooled[:rows].to(torch.float32), rows, None)

    @property
    def rows(self) -> int:
        """Number of vectors (sequences) this handle will yield."""
        return self._rows

    def done(self) -> bool:
        """True when `result()` will not block."""
        return self._event is None or self._event.query()

    def result(self) -> np.ndarray:
        """float32 [rows, dimensions]: raw pooled vectors (not normalized, not truncated)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()
