"""A step's life after composition, shared by the engine threads and the loop launch: charge, run, fail, deliver.

`_compose_locked` wraps the pure `compose` with its side effects: expired requests are
marked and posted to the loop (Admission._post), and the step is charged to its worker's load.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sidecar.lanes import Lane, Request
from sidecar.scheduler.compose import Step, compose, compose_online
from sidecar.scheduler.errors import deadline_passed
from sidecar.scheduler.state import SchedulerState
from sidecar.scheduler.worker import Worker

log = logging.getLogger("sidecar.scheduler")

FAILED = object()  # what an engine call returns here when it raised (its step was failed)


class StepLifecycle(SchedulerState):
    """Taking a step off the lanes for a worker, running its engine calls, and settling what it carried."""

    def _compose_locked(self, worker: Worker) -> Step | None:
        """This worker's next step from both lanes (see `compose`); None if nothing was left (lock held)."""
        step, expired = compose(self._lanes, self.config, time.monotonic())
        self._post(self._expire_locked(expired), room_freed=True)
        if step is not None:
            self._hold_locked(worker, step)
        return step

    def _online_step_locked(self, worker: Worker, budget: int) -> Step | None:
        """A step of queued online work only, up to `budget` tokens; None if none is left (lock held)."""
        step, expired = compose_online(self._lanes[Lane.ONLINE], budget, self.config.max_step_sequences,
                                       time.monotonic())
        self._post(self._expire_locked(expired), room_freed=True)
        if step is not None:
            self._hold_locked(worker, step)
        return step

    def _hold_locked(self, worker: Worker, step: Step) -> None:
        """Charge a composed step to its worker, which takes no more work until it launches (lock held)."""
        worker.load += step.tokens
        worker.holding = True

    def _expire_locked(self, requests: list[Request]) -> list[tuple[Request, BaseException | None]]:
        outcomes = []
        for request in requests:
            if request.settled:
                continue
            request.settled = True
            request.dropped = True
            self._counters[request.lane].expired += 1
            outcomes.append((request, deadline_passed(request)))
        return outcomes

    def _call(self, worker: Worker, step: Step, call: Any, *args: Any) -> Any:
        """Run an engine call for `step`; if it raises, fail the step's requests with that error."""
        try:
            return call(*args)
        except Exception as error:  # goes to every caller whose sequences were in the step
            log.exception("engine %d (%s) failed a step of %d tokens", worker.index, worker.device, step.tokens)
            self._fail(worker, step, error)
            return FAILED

    def _prepare(self, worker: Worker, step: Step) -> Any:
        """`engine.prepare` for `step` (FAILED if it raised), asking for token outputs when a request
        in the step wants them."""
        if any(chunk.request.token_out is not None for chunk in step.chunks):
            return self._call(worker, step, worker.engine.prepare, step.sequences, True)
        return self._call(worker, step, worker.engine.prepare, step.sequences)

    def _launched(self, worker: Worker, step: Step, *, by_loop: bool = False) -> None:
        with self._cond:
            worker.loop_launches += by_loop
            worker.holding = False
            worker.steps += 1
            worker.tokens += step.tokens
            worker.sequences += len(step.sequences)
            self._steps += 1
            self._tokens += step.tokens

    def _fail(self, worker: Worker, step: Step, error: Exception) -> None:
        outcomes: list[tuple[Request, BaseException | None]] = []
        with self._cond:
            worker.load -= step.tokens
            worker.holding = False
            for chunk in step.chunks:
                request = chunk.request
                if request.settled:
                    continue
                request.settled = True
                request.dropped = True
                self._lanes[request.lane].drop(request)
                outcomes.append((request, error))
            self._cond.notify_all()
            self._loads.notify_all()
        self._post(outcomes, room_freed=True)

    def _deliver(self, worker: Worker, step: Step, rows: Any, *, on_loop: bool = False) -> None:
        """Copy a finished step's rows into their requests; post the requests now complete
        (settle them at once when called on the loop).

        `rows` is the pooled float32 [B, D], or a core_engine.token_outputs.StepResult (pooled, token
        outputs) for a step prepared with token outputs.
        """
        outcomes: list[tuple[Request, BaseException | None]] = []
        tokens = getattr(rows, "tokens", None)
        if tokens is not None:
            rows = rows.pooled
        with self._cond:
            worker.load -= step.tokens
            offset = 0
            for chunk in step.chunks:
                request = chunk.request
                n = chunk.size
                if not request.dropped:
                    request.out[chunk.start : chunk.end] = rows[offset : offset + n]
                    if request.token_out is not None and tokens is not None:
                        for j in range(n):
                            request.token_out[chunk.start + j] = tokens.rows(offset + j)
                    self._counters[request.lane].tokens += chunk.tokens
                    request.remaining -= n
                    if request.remaining == 0:
                        request.settled = True
                        self._counters[request.lane].completed += 1
                        outcomes.append((request, None))
                offset += n
            self._loads.notify_all()  # a busy worker may now be the least loaded
        if on_loop:
            self._settle_on_loop(outcomes)
        else:
            self._post(outcomes, room_freed=False)
