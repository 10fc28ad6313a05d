"""The per-engine pipeline thread: while step N runs, build step N+1, then collect N and launch N+1.

Each engine gets one thread. It builds step N+1 (`engine.prepare`, CPU only) from the work
queued when N was launched, then collects N through its handle and launches N+1; online
work that arrives after N+1 was built gets a small step of its own launched just before
N+1, so a query waits for at most the step in flight, and its answer goes out as soon as
that small step is done, before the thread builds N+2. With nothing queued, the thread
blocks in N's `result()` (on CUDA an event wait that releases the GIL): it sees N finish
at once instead of polling, and work that arrives meanwhile is built as soon as N is
collected. With several engines, an idle one takes new work before a busy one builds
ahead (least-loaded first).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np

from sidecar.lanes import Lane
from sidecar.scheduler.compose import Step
from sidecar.scheduler.steps import FAILED, StepLifecycle
from sidecar.scheduler.worker import Worker

log = logging.getLogger("sidecar.scheduler")

# A worker that leaves queued work to a less loaded one (several engines) checks this often
# whether its own step has finished; a change of loads wakes it at once.
_POLL_S = 0.0002


class Pipeline(StepLifecycle):
    """The engine threads' side of the scheduler: `_work` is each thread's body."""

    def _work(self, worker: Worker) -> None:
        """The pipeline: build N+1 while N runs, collect N, launch N+1.

        If online work arrived after N+1 was built without it, a small online-only step
        is launched just before N+1, so the query waits only for the step that was in
        flight and the big prepared step is not rebuilt. On an asynchronous (CUDA) engine
        N+1 is launched before N's results are handed out, so the device idles as little
        as possible; on a synchronous one (CPU, where step() computes) N is handed out
        first, or its callers would wait for N+1 as well.
        """
        launch_first = worker.launches_async
        in_flight: deque[tuple[Step, Any]] = deque()
        while True:
            self._hand_out_online(worker, in_flight)
            nxt = self._next_step(worker, in_flight=in_flight[-1][1] if in_flight else None)
            if worker.adopted is not None:  # composed (and mostly launched) by the loop meanwhile
                with self._cond:
                    step, prepared, handle = worker.adopted
                    worker.adopted = None
                if handle is None:
                    self._launch(worker, step, prepared, in_flight)
                    if not in_flight:  # the launch failed (its step was failed): not a stop
                        continue
                else:
                    in_flight.append((step, handle))
                if nxt is None and in_flight:  # build what queued meanwhile while that step runs
                    nxt = self._next_step(worker, in_flight=in_flight[-1][1])
            if nxt is None and not in_flight:
                return
            prepared: Any = FAILED
            if nxt is not None:
                prepared = self._prepare(worker, nxt)
                if prepared is FAILED:
                    nxt = None
            waited = bool(in_flight)
            deferred: tuple[Step, np.ndarray] | None = None
            while in_flight:  # oldest first: a jump step's online results go out first
                step, handle = in_flight.popleft()
                rows = self._call(worker, step, handle.result)
                if rows is FAILED:
                    continue
                if launch_first and not in_flight and nxt is not None:
                    deferred = (step, rows)
                else:
                    self._deliver(worker, step, rows)
            if nxt is not None and waited:
                # Time passed while the last step ran: requests may have gone.
                nxt, prepared = self._revalidate(worker, nxt, prepared)
                if nxt is not None:
                    jump = self._jump_step(worker, nxt)
                    if jump is not None:
                        self._launch(worker, jump, None, in_flight)
                        if not launch_first:  # computed already: out before `nxt` is computed
                            self._hand_out_online(worker, in_flight, ahead_of_more=False)
            if nxt is not None:
                self._launch(worker, nxt, prepared, in_flight)
            if deferred is not None:
                self._deliver(worker, *deferred)

    def _hand_out_online(self, worker: Worker, in_flight: deque, *, ahead_of_more: bool = True) -> None:
        """Collect and deliver the oldest steps in flight while they carry online work.

        With `ahead_of_more`, only those with a later step queued behind them on the device (a
        jump step ahead of the batch step it jumped): the device stays busy with that step
        while the query's answer goes out, instead of after the engine thread has built the
        next batch step. Without, any such step (on a synchronous engine, already computed).
        """
        while len(in_flight) > (1 if ahead_of_more else 0) and _carries_online(in_flight[0][0]):
            step, handle = in_flight.popleft()
            rows = self._call(worker, step, handle.result)
            if rows is not FAILED:
                self._deliver(worker, step, rows)

    def _launch(self, worker: Worker, step: Step, prepared: Any, in_flight: deque) -> None:
        """Prepare (when `prepared` is None) and start a step; a failure fails its requests."""
        if prepared is None:
            prepared = self._prepare(worker, step)
            if prepared is FAILED:
                return
        handle = self._call(worker, step, worker.engine.step, prepared)
        if handle is not FAILED:
            self._launched(worker, step)
            in_flight.append((step, handle))

    def _next_step(self, worker: Worker, *, in_flight: Any) -> Step | None:
        """Compose this worker's next step.

        With nothing in flight, block until there is work (None: stopping). With a step in
        flight, take the work queued now if this worker should (the prefetch). If nothing
        is queued, return None at once to collect the step: a wait in `result()` sees it
        end sooner than polling would, and wakes no thread meanwhile. If queued work is
        left to a less loaded worker, return when this worker should take it after all or
        its step is done (None), whichever comes first. A step the loop launched here makes
        the worker busy as well, though its thread, with nothing of its own in flight, waits
        for work as an idle one: it takes the work once that step is done.
        """
        with self._cond:
            while True:
                if worker.claimed:  # the loop is launching a step here: wait for what it hands over
                    self._wait_idle_locked(worker)
                    continue
                if worker.adopted is not None:
                    return None  # _work collects it
                idle = in_flight is None and not worker.loop_steps
                if self._has_work_locked():
                    if idle or self._least_loaded_locked(worker):
                        step = self._compose_locked(worker)
                        if step is None:
                            continue  # everything found was dropped or expired; look again
                        if self._has_work_locked():
                            self._cond.notify()  # more than a step's worth: wake another idle worker
                        return step
                    if in_flight is None:
                        # Busy with the loop's step only: the wake-up that brought this thread
                        # here may have been meant for an idle worker, so pass it on.
                        self._cond.notify()
                    elif self._finished(worker, in_flight):
                        return None
                    self._loads.wait(_POLL_S)
                elif in_flight is not None or self._stopping:
                    return None
                else:
                    self._wait_idle_locked(worker)

    def _wait_idle_locked(self, worker: Worker) -> None:
        """Wait for work with nothing in flight: the loop may claim this engine meanwhile (lock held)."""
        worker.waiting = True
        try:
            self._cond.wait()
        finally:
            worker.waiting = False

    def _finished(self, worker: Worker, handle: Any) -> bool:
        """Whether a step in flight is done; one whose done() raises counts as done (lock held).

        Its result() then answers for it, through `_call`: failing the step here would take
        the lock again.
        """
        try:
            return bool(handle.done())
        except Exception:
            log.exception("engine %d (%s): done() failed; collecting the step", worker.index, worker.device)
            return True

    def _least_loaded_locked(self, worker: Worker) -> bool:
        """A worker with a step in flight takes more only if no free worker has less load."""
        return all(
            worker.load <= other.load
            for other in self._workers
            if other is not worker and not other.holding
        )

    def _revalidate(self, worker: Worker, step: Step, prepared: Any) -> tuple[Step | None, Any]:
        """Rebuild a prepared step whose requests were cancelled or expired meanwhile."""
        now = time.monotonic()
        with self._cond:
            if not any(c.request.dropped or c.request.expired(now) for c in step.chunks):
                return step, prepared
            # Put the chunks back at the front of their lanes (FCFS holds), then compose anew;
            # the compose drops the expired ones and skips the cancelled ones.
            for lane in (Lane.BATCH, Lane.ONLINE):
                self._lanes[lane].push_front([c for c in step.chunks if c.request.lane == lane])
            worker.load -= step.tokens
            worker.holding = False
            fresh = self._compose_locked(worker)
        if fresh is None:
            return None, FAILED
        prepared = self._prepare(worker, fresh)
        return (fresh, prepared) if prepared is not FAILED else (None, FAILED)

    def _jump_step(self, worker: Worker, step: Step) -> Step | None:
        """An online-only step to run before `step`, for online work that came after it was built.

        Only when `step` carries no online work: otherwise newer queries would overtake
        older ones, and they wait for `step`, which is short (an online step's budget).
        """
        with self._cond:
            if _carries_online(step):
                return None
            if not self._lanes[Lane.ONLINE].has_work():
                return None
            return self._online_step_locked(worker, self.config.online_step_tokens)


def _carries_online(step: Step) -> bool:
    return any(chunk.request.lane == Lane.ONLINE for chunk in step.chunks)
