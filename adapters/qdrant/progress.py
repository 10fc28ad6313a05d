"""A one-line ingest progress display for terminals (silent when stderr is not a TTY)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Rewrites one status line (rows done, rows/s) at most every `interval` seconds."""

    def __init__(self, label: str, *, total: int | None = None, stream: TextIO | None = None,
                 enabled: bool | None = None, interval: float = 0.2):
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval = interval
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, rows: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self._last < self.interval:
            return
        self._last = now
        self._draw(rows, now)

    def close(self, rows: int) -> None:
        if self.enabled:
            self._draw(rows, time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, rows: int, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        done = f"{rows:,}" if self.total is None else f"{rows:,}/{self.total:,} ({100 * rows / max(self.total, 1):.0f}%)"
        self.stream.write(f"\r{self.label}: {done} rows, {rows / elapsed:,.0f} rows/s ")
        self.stream.flush()
