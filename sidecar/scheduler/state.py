"""The state the scheduler's parts share: lanes, workers, counters, and the one lock over them."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from sidecar.lanes import Lane, LaneQueue, Request
from sidecar.scheduler.config import SchedulerConfig
from sidecar.scheduler.stats import LaneCounters
from sidecar.scheduler.worker import EngineLike, Worker


@dataclass(eq=False)
class Waiter:
    """An asyncio task waiting for room in a lane; `request` is set when it waits to be admitted."""

    lane: Lane
    tokens: int
    future: asyncio.Future
    request: Request | None = None


class SchedulerState:
    """Built once per scheduler; admission, the pipeline threads and the loop launch all read it.

    One lock guards lanes, requests' bookkeeping and worker loads. Idle workers wait on
    `_cond` for work; a busy worker that leaves queued work to a less loaded one waits on
    `_loads` for loads to change (several engines only). Attributes marked "loop thread
    only" are touched by the event loop alone and need no lock.
    """

    def __init__(self, engines: Sequence[EngineLike], config: SchedulerConfig | None = None) -> None:
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        dims = {int(e.spec.dimensions) for e in engines}
        if len(dims) != 1:
            raise ValueError(f"Scheduler engines disagree on dimensions: {sorted(dims)}")
        self.config = config or SchedulerConfig()
        self.dimensions = dims.pop()
        self._workers = [Worker(i, e) for i, e in enumerate(engines)]
        self._lanes = {lane: LaneQueue(lane, self.config.bound(lane)) for lane in Lane}
        self._counters = {lane: LaneCounters() for lane in Lane}
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._loads = threading.Condition(lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[Waiter] = deque()  # loop thread only
        self._live: set[Request] = set()  # admitted, not yet settled; loop thread only
        self._drained: asyncio.Event | None = None
        self._collecting: set[asyncio.Task] = set()  # steps the loop launched and waits for
        self._draining = False
        self._stopping = False
        self._steps = 0
        self._tokens = 0

    def _has_work_locked(self) -> bool:
        return any(q.has_work() for q in self._lanes.values())
