"""The scheduler's two lanes: FCFS queues of sequence chunks with token accounting."""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


class Lane(enum.IntEnum):
    """Which queue a request rides; the numbers match the proto's `Lane` enum."""

    ONLINE = 0  # query time: strict priority, small steps
    BATCH = 1  # ingest: fills whatever budget ONLINE leaves


@dataclass(eq=False)
class Request:
    """One `Scheduler.embed` call: its sequences, where their vectors go, and its fate.

    Every field is read and written under the scheduler's lock, except `out`, whose
    rows each step writes from its engine thread (no two steps share a row).
    """

    lane: Lane
    sequences: Sequence[Sequence[int]]
    offsets: list[int]  # [N+1]: offsets[i] = tokens in sequences[:i] (Python ints: no numpy
    # scalar arithmetic on a query's path, where every call runs on cold caches)
    deadline: float | None  # time.monotonic()
    out: np.ndarray  # float32 [N, D], filled as steps complete
    remaining: int  # sequences whose vectors have not come back yet
    queued_tokens: int = 0  # tokens of this request still waiting in its lane
    dropped: bool = False  # cancelled, past its deadline, or failed: skip what is left
    settled: bool = False  # its future has been (or is being) resolved
    future: Any = None  # asyncio.Future, created when the request is admitted to its lane
    # Per sequence, its token heads' rows (core_engine.token_outputs.TokenRows), when the request asked
    # for token outputs (learned sparse, multi-vectors); None otherwise. Written like `out`.
    token_out: list | None = None

    @property
    def size(self) -> int:
        return len(self.sequences)

    def tokens(self, start: int, end: int) -> int:
        return self.offsets[end] - self.offsets[start]

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


@dataclass(eq=False)
class Chunk:
    """Sequences [start, end) of one request: the unit a lane queues and a step carries."""

    request: Request
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.request.tokens(self.start, self.end)

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class Take:
    """What `LaneQueue.take` removed: chunks for the step, and requests found expired."""

    chunks: list[Chunk] = field(default_factory=list)
    tokens: int = 0
    sequences: int = 0
    expired: list[Request] = field(default_factory=list)


class LaneQueue:
    """First come, first served queue of chunks for one lane, bounded in queued tokens."""

    def __init__(self, lane: Lane, max_queued_tokens: int) -> None:
        self.lane = lane
        self.max_queued_tokens = max_queued_tokens
        self.tokens = 0  # tokens queued and not dropped
        self.high_water = 0  # the most tokens ever queued at once
        self.requests = 0  # live requests with tokens still queued
        self._chunks: deque[Chunk] = deque()

    def fits(self, tokens: int) -> bool:
        return self.tokens + tokens <= self.max_queued_tokens

    def push(self, request: Request) -> None:
        """Queue all of a new request's sequences at the back."""
        self._chunks.append(Chunk(request, 0, request.size))
        self._add(request, request.tokens(0, request.size))

    def push_front(self, chunks: Sequence[Chunk]) -> None:
        """Put a step's chunks back at the front, in their order (the step was rebuilt)."""
        for chunk in reversed(chunks):
            if chunk.request.dropped:
                continue
            self._chunks.appendleft(chunk)
            # Not a new admission: these tokens were admitted under the bound and held by
            # a step all along, so they do not move the high-water mark.
            self._add(chunk.request, chunk.tokens, admitted=False)

    def drop(self, request: Request) -> None:
        """Forget what is left of a request; its chunks are skipped when reached."""
        if request.queued_tokens:
            self.tokens -= request.queued_tokens
            self.requests -= 1
            request.queued_tokens = 0

    def has_work(self) -> bool:
        while self._chunks and self._chunks[0].request.dropped:
            self._chunks.popleft()
        return bool(self._chunks)

    def take(self, budget: int, max_sequences: int, now: float, *, oversize_ok: bool) -> Take:
        """Remove chunks from the front while they fit in `budget` tokens.

        A chunk is split at the last sequence that fits. With `oversize_ok` (the step is
        still empty) a first sequence longer than the whole budget is taken alone, so a
        long sequence is never stuck behind a budget it can never fit in.
        """
        took = Take()
        while self._chunks and took.sequences < max_sequences:
            chunk = self._chunks[0]
            request = chunk.request
            if request.dropped:
                self._chunks.popleft()
                continue
            if request.expired(now):
                self._chunks.popleft()
                self.drop(request)
                took.expired.append(request)
                continue
            room = budget - took.tokens
            # Largest end with tokens(start, end) <= room.
            limit = request.offsets[chunk.start] + room
            end = bisect_right(request.offsets, limit) - 1
            end = min(end, chunk.end, chunk.start + max_sequences - took.sequences)
            if end <= chunk.start:
                if oversize_ok and not took.chunks:
                    end = chunk.start + 1
                else:
                    break
            piece = Chunk(request, chunk.start, end)
            split = end < chunk.end
            if split:
                chunk.start = end
            else:
                self._chunks.popleft()
            self._remove(request, piece.tokens)
            took.chunks.append(piece)
            took.tokens += piece.tokens
            took.sequences += piece.size
            if split:
                break  # the rest of this chunk did not fit
        return took

    def _add(self, request: Request, tokens: int, *, admitted: bool = True) -> None:
        if request.queued_tokens == 0:
            self.requests += 1
        request.queued_tokens += tokens
        self.tokens += tokens
        if admitted:
            self.high_water = max(self.high_water, self.tokens)

    def _remove(self, request: Request, tokens: int) -> None:
        request.queued_tokens -= tokens
        self.tokens -= tokens
        if request.queued_tokens == 0:
            self.requests -= 1
