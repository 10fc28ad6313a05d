"""The adapters' progress bar: tqdm on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


# "ingest docs: 50/200 rows |#####     | 25% 812 rows/s eta 00:02"; with no total, "fern worker: 50 rows 812 rows/s".
_WITH_TOTAL = "{desc}: {n_fmt}/{total_fmt} rows |{bar:20}| {percentage:3.0f}% {rate_fmt} eta {remaining}"
_WITHOUT_TOTAL = "{desc}: {n_fmt} rows {rate_fmt}"


class Progress:
    """Rows done, rows/s and (with a total) a bar and an ETA, redrawn at most every `interval` s.

    `update(rows)` sets how many rows are done; `advance(rows, remaining)` adds rows and,
    when the caller knows how many are left (a queue's depth), moves the total to match.
    The bar is drawn from the first update; `close()` ends its line, and a later update
    starts a new one (a worker that reconnects goes on counting).
    """

    def __init__(self, label: str, *, total: int | None = None, stream: TextIO | None = None,
                 enabled: bool | None = None, interval: float = 0.2) -> None:
        self.label, self.total, self.interval = label, total, interval
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self._bar: tqdm | None = None

    def update(self, rows: int) -> None:
        self.advance(rows - self.done)

    def advance(self, rows: int, remaining: int | None = None) -> None:
        self.done += rows
        if not self.enabled:
            return
        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(total=self.total, initial=self.done - rows, desc=self.label, unit=" rows",
                                   file=self.stream, mininterval=self.interval, miniters=1, ascii=True,
                                   bar_format=_WITH_TOTAL if self.total is not None else _WITHOUT_TOTAL)
        if remaining is not None:
            bar.total = self.done + remaining
            bar.bar_format = _WITH_TOTAL
        bar.update(rows)

    def close(self, rows: int | None = None) -> None:
        if rows is not None:
            self.update(rows)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
