"""The Scheduler: admission on the event loop, one pipeline thread per engine, and the loop-launch fast path.

ONLINE (queries) has strict priority; BATCH (ingest) fills what is left of each step's
token budget (compose.py). Requests are admitted on the asyncio loop into bounded lanes
(admission.py); each engine's thread pipelines steps (pipeline.py); an ONLINE request that
finds an asynchronous engine idle is launched from the loop itself (launch.py). Results
reach the loop with `call_soon_threadsafe`; the loop never blocks on an engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from sidecar.lanes import Lane
from sidecar.scheduler.admission import Admission
from sidecar.scheduler.errors import Draining
from sidecar.scheduler.launch import LoopLaunch
from sidecar.scheduler.pipeline import Pipeline
from sidecar.scheduler.stats import EngineStats, LaneStats, SchedulerStats

log = logging.getLogger("sidecar.scheduler")


class Scheduler(Admission, LoopLaunch, Pipeline):
    """Feeds one or more engines from two token-bounded lanes: `Scheduler(engines, config)`.

    `await start()` on the serving loop, then `embed(...)` / `wait_for_room(...)`, and
    `await drain()` to finish; `stats()` at any time. The shared state is SchedulerState's.
    """

    async def start(self) -> None:
        """Start one worker thread per engine; call once from the serving event loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        for worker in self._workers:
            worker.thread = threading.Thread(
                target=self._work, args=(worker,), name=f"fern-engine-{worker.index}", daemon=True
            )
            worker.thread.start()

    async def drain(self) -> None:
        """Stop accepting (Draining), finish everything queued and in flight, stop the threads."""
        if not self._draining:
            self._draining = True
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(Draining("the scheduler is draining"))
        if self._loop is None:
            return
        while self._live:
            self._drained.clear()
            await self._drained.wait()
        if self._collecting:  # steps of cancelled requests still in flight: the engine is busy with them
            await asyncio.gather(*self._collecting, return_exceptions=True)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        threads = [w.thread for w in self._workers if w.thread is not None]
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        stats = self.stats()
        log.info(
            "scheduler drained: %d steps, %d tokens; ONLINE high water %d of %d tokens, "
            "BATCH high water %d of %d tokens; rejected %d/%d, cancelled %d/%d, expired %d/%d "
            "(online/batch)",
            stats.steps, stats.tokens,
            stats.online.high_water_tokens, stats.online.max_queued_tokens,
            stats.batch.high_water_tokens, stats.batch.max_queued_tokens,
            stats.online.rejected, stats.batch.rejected,
            stats.online.cancelled, stats.batch.cancelled,
            stats.online.expired, stats.batch.expired,
        )

    def stats(self) -> SchedulerStats:
        """A consistent snapshot of the counters."""
        with self._cond:
            lanes = {
                lane: LaneStats(
                    queued_tokens=q.tokens,
                    queued_requests=q.requests,
                    max_queued_tokens=q.max_queued_tokens,
                    high_water_tokens=q.high_water,
                    admitted=self._counters[lane].admitted,
                    rejected=self._counters[lane].rejected,
                    cancelled=self._counters[lane].cancelled,
                    expired=self._counters[lane].expired,
                    completed=self._counters[lane].completed,
                    tokens=self._counters[lane].tokens,
                )
                for lane, q in self._lanes.items()
            }
            engines = tuple(
                EngineStats(w.device, w.steps, w.tokens, w.sequences, w.load, w.loop_launches)
                for w in self._workers
            )
            return SchedulerStats(
                online=lanes[Lane.ONLINE],
                batch=lanes[Lane.BATCH],
                engines=engines,
                steps=self._steps,
                tokens=self._tokens,
                draining=self._draining,
            )
