"""EmbeddingHandle, Fern's LazyTensor: a step's pooled vectors arriving in pinned host memory behind a CUDA event."""

from __future__ import annotations

import numpy as np
import torch

from core_engine.token_outputs import StepResult, TokenOutputs


class EmbeddingHandle:
    """The pending result of one `Engine.step()`.

    On CUDA the pooled rows are copied into a pinned host buffer with a non-blocking copy and a
    CUDA event is recorded after it, so `step()` returns before the GPU has finished; `done()`
    polls the event and `result()` waits on it. On the CPU the buffer is already filled.
    """

    __slots__ = ("_host", "_event", "_rows", "_tokens")

    def __init__(self, host: torch.Tensor, rows: int, event: "torch.cuda.Event | None" = None,
                 tokens: tuple[torch.Tensor, np.ndarray, bool] | None = None) -> None:
        self._host = host
        self._rows = rows
        self._event = event
        self._tokens = tokens  # (head rows [T_real, width] on the host, cu_seqlens [B + 1], has sparse)

    @classmethod
    def from_device(cls, pooled: torch.Tensor, rows: int,
                    tokens: tuple[torch.Tensor, np.ndarray, bool] | None = None) -> "EmbeddingHandle":
        """Start the asynchronous copy of `pooled[:rows]` (float32, on CUDA) into pinned memory.

        `tokens`: (head rows [T, width] on the device, cu_seqlens [B + 1] of the texts, has a
        sparse head); its first cu_seqlens[B] rows (the real tokens) are copied too.
        """
        host = torch.empty((rows, pooled.shape[1]), dtype=torch.float32, pin_memory=True)
        host.copy_(pooled[:rows], non_blocking=True)
        host_tokens = None
        if tokens is not None:
            values, cu, sparse = tokens
            real = int(cu[-1])
            copied = torch.empty((real, values.shape[1]), dtype=torch.float32, pin_memory=True)
            copied.copy_(values[:real], non_blocking=True)
            host_tokens = (copied, cu, sparse)
        event = torch.cuda.Event()
        event.record()
        return cls(host, rows, event, host_tokens)

    @classmethod
    def ready(cls, pooled: torch.Tensor, rows: int,
              tokens: tuple[torch.Tensor, np.ndarray, bool] | None = None) -> "EmbeddingHandle":
        """A handle for a CPU step whose result is already computed (`tokens` as for `from_device`)."""
        if tokens is not None:
            values, cu, sparse = tokens
            tokens = (values[: int(cu[-1])].to(torch.float32), cu, sparse)
        return cls(pooled[:rows].to(torch.float32), rows, None, tokens)

    @property
    def rows(self) -> int:
        """Number of vectors (sequences) this handle will yield."""
        return self._rows

    def done(self) -> bool:
        """True when `result()` will not block."""
        return self._event is None or self._event.query()

    def result(self) -> np.ndarray | StepResult:
        """float32 [rows, dimensions]: raw pooled vectors (not normalized, not truncated).

        A step prepared with ``token_outputs`` yields a StepResult: those vectors and the token
        heads' rows of each text.
        """
        if self._event is not None:
            self._event.synchronize()
        if self._tokens is None:
            return self._host.numpy()
        values, cu, sparse = self._tokens
        return StepResult(self._host.numpy(), TokenOutputs(values.numpy(), cu, sparse))
