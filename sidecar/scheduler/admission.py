"""Admission on the event loop: bounded lanes, waiters for room (backpressure), and settling requests.

A request is queued only if its lane has room in tokens; otherwise it is rejected
(QueueFull) or, on the stream path, waits first come, first served for room. Cancelled or
expired requests are dropped before their sequences reach an engine. Engine threads hand
finished requests back through `_post`; the loop resolves their futures.
"""

from __future__ import annotations

import asyncio
import time
from itertools import accumulate
from typing import Sequence

import numpy as np

from sidecar.lanes import Lane, Request
from sidecar.scheduler.errors import DeadlineExceeded, Draining, QueueFull, deadline_passed
from sidecar.scheduler.state import SchedulerState, Waiter

# A caller's cancel that lands this close to its request's deadline is counted as the deadline:
# the expiry timer and gRPC's own deadline cancel race on the loop, and either may run first.
DEADLINE_SLACK_S = 0.005


class Admission(SchedulerState):
    """The scheduler's event-loop side; an admitted ONLINE request may launch at once (LoopLaunch)."""

    async def embed(
        self,
        sequences: Sequence[Sequence[int]],
        lane: Lane = Lane.ONLINE,
        deadline: float | None = None,
        *,
        wait: bool = False,
        token_outputs: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, list]:
        """Embed token-id sequences; returns float32 [N, D] raw pooled vectors in input order.

        With `token_outputs` (an engine whose model has token heads), returns (vectors, rows):
        `rows[i]` is sequence i's core_engine.token_outputs.TokenRows.

        Raises QueueFull at once when the lane has no room (with `wait=True` it waits its
        turn for room instead, FIFO with other waiters: the stream path), Draining after
        `drain()`, DeadlineExceeded when `deadline` (time.monotonic()) passes first.
        Cancelling the awaiting task drops its sequences that have not reached an engine.
        """
        lane = Lane(lane)
        self._check_open()
        request = self._new_request(sequences, lane, deadline)
        if token_outputs:
            request.token_out = [None] * request.size
        if request.size == 0:
            return request.out if request.token_out is None else (request.out, request.token_out)
        if request.expired(time.monotonic()):
            with self._cond:  # the engine thread counts expiries too
                self._counters[lane].expired += 1
            raise DeadlineExceeded(f"deadline passed before the {lane.name} request was queued")
        queue = self._lanes[lane]
        tokens = request.tokens(0, request.size)
        self._check_bound(lane, tokens)
        timer = None
        if deadline is not None:
            timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, request)
        try:
            with self._cond:
                lane_has_waiters = bool(self._waiters) and any(w.lane == lane for w in self._waiters)
                admitted = queue.fits(tokens) and not (wait and lane_has_waiters)
                claim = None
                if admitted:
                    self._admit_locked(request, wake=False)
                    if lane is Lane.ONLINE and self.config.launch_on_arrival:
                        claim = self._claim_locked()
                    if claim is None or self._has_work_locked():
                        self._wake_locked()  # not the claimed engine's thread: it would only wait again
            if claim is not None:
                self._launch_on_loop(*claim)
            if not admitted:
                if not wait:
                    self._counters[lane].rejected += 1
                    raise QueueFull(
                        f"{lane.name} queue is full: {queue.tokens} of {queue.max_queued_tokens} "
                        f"tokens queued, request needs {tokens}"
                    )
                waiter = Waiter(lane, tokens, self._loop.create_future(), request)
                self._waiters.append(waiter)
                try:
                    await waiter.future
                except asyncio.CancelledError:
                    if waiter.future.cancelled():
                        self._forget_waiter(waiter)
                    else:
                        self._cancelled(request)  # admitted just before the cancel landed
                    raise
            try:
                return await request.future
            except asyncio.CancelledError:
                self._cancelled(request)
                raise
        finally:
            if timer is not None:
                timer.cancel()

    async def wait_for_room(self, lane: Lane, tokens: int) -> None:
        """Return once `tokens` more fit in `lane`'s queue (stream flow control).

        Waiters are served first come, first served, and one wake-up never promises the
        same room twice; call `embed` right after, with no other await in between (or use
        `embed(..., wait=True)`, which admits atomically).
        """
        lane = Lane(lane)
        self._check_open()
        self._check_bound(lane, tokens)
        with self._cond:
            fits = self._lanes[lane].fits(tokens)
        if fits and not any(w.lane == lane for w in self._waiters):
            return
        waiter = Waiter(lane, tokens, self._loop.create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._forget_waiter(waiter)
            raise

    def _check_open(self) -> None:
        if self._draining:
            raise Draining("the scheduler is draining")
        if self._loop is None:
            raise RuntimeError("Scheduler.start() has not been awaited")

    def _check_bound(self, lane: Lane, tokens: int) -> None:
        bound = self._lanes[lane].max_queued_tokens
        if tokens > bound:
            self._counters[lane].rejected += 1
            raise QueueFull(
                f"request of {tokens} tokens exceeds the {lane.name} lane's whole queue bound "
                f"of {bound} tokens"
            )

    def _new_request(self, sequences: Sequence[Sequence[int]], lane: Lane, deadline: float | None) -> Request:
        lengths = list(map(len, sequences))
        if lengths and min(lengths) == 0:
            raise ValueError(f"sequences[{lengths.index(0)}]: empty token sequence")
        offsets = list(accumulate(lengths, initial=0))
        return Request(
            lane=lane,
            sequences=sequences,
            offsets=offsets,
            deadline=deadline,
            out=np.empty((len(sequences), self.dimensions), dtype=np.float32),
            remaining=len(sequences),
        )

    def _admit_locked(self, request: Request, *, wake: bool = True) -> None:
        """Queue a request (loop thread, lock held); `wake=False` leaves waking a worker to the caller."""
        request.future = self._loop.create_future()
        self._live.add(request)
        self._lanes[request.lane].push(request)
        self._counters[request.lane].admitted += 1
        if wake:
            self._wake_locked()

    def _wake_locked(self) -> None:
        # Any idle worker takes the work, and one that leaves work behind wakes the next
        # (Pipeline._next_step): one wake-up is enough.
        self._cond.notify()
        self._loads.notify_all()

    def _expire(self, request: Request) -> None:
        self._drop(request, deadline_passed(request))

    def _cancelled(self, request: Request) -> None:
        """Drop a request whose caller cancelled it: as expired when the cancel lands at its
        deadline (gRPC cancels a call then, at about the moment `_expire`'s timer would fire;
        whichever runs first, the request expired), else as cancelled."""
        if request.expired(time.monotonic() + DEADLINE_SLACK_S):
            self._expire(request)
        else:
            self._drop(request, None)

    def _drop(self, request: Request, error: BaseException | None) -> None:
        """Cancel (error None) or expire a request: its queued sequences never reach an engine."""
        with self._cond:
            if request.settled:
                return
            request.settled = True
            request.dropped = True
            self._lanes[request.lane].drop(request)
            counters = self._counters[request.lane]
            if error is None:
                counters.cancelled += 1
            else:
                counters.expired += 1
        for waiter in self._waiters:
            if waiter.request is request:  # still waiting for room: it was never queued
                self._waiters.remove(waiter)
                if error is not None and not waiter.future.done():
                    waiter.future.set_exception(error)
                break
        self._finish(request, error)
        self._wake_waiters()

    def _finish(self, request: Request, error: BaseException | None) -> None:
        """Resolve a settled request's future (loop thread) and account for drain."""
        future = request.future
        if future is not None and not future.done():
            if error is None:
                if request.dropped:
                    future.cancel()
                else:
                    future.set_result(request.out if request.token_out is None
                                      else (request.out, request.token_out))
            else:
                future.set_exception(error)
        self._live.discard(request)
        if not self._live and self._drained is not None:
            self._drained.set()

    def _settle_on_loop(self, outcomes: list[tuple[Request, BaseException | None]]) -> None:
        for request, error in outcomes:
            self._finish(request, error)
        self._wake_waiters()

    def _forget_waiter(self, waiter: Waiter) -> None:
        if waiter in self._waiters:  # else already served, or rejected by drain()
            self._waiters.remove(waiter)
        self._wake_waiters()  # whoever queued behind it may fit now

    def _wake_waiters(self) -> None:
        """Serve waiters FCFS per lane while room lasts (loop thread)."""
        if not self._waiters:
            return
        promised = {lane: 0 for lane in Lane}
        blocked: set[Lane] = set()
        with self._cond:
            for waiter in list(self._waiters):
                if waiter.lane in blocked:
                    continue
                if waiter.future.done():
                    self._waiters.remove(waiter)
                    continue
                queue = self._lanes[waiter.lane]
                if not queue.fits(promised[waiter.lane] + waiter.tokens):
                    blocked.add(waiter.lane)
                    continue
                self._waiters.remove(waiter)
                if waiter.request is not None:
                    self._admit_locked(waiter.request)
                else:
                    promised[waiter.lane] += waiter.tokens
                waiter.future.set_result(None)

    def _post(self, outcomes: list[tuple[Request, BaseException | None]], room_freed: bool) -> None:
        """From a worker thread: hand finished requests and freed room to the loop."""
        if outcomes or (room_freed and self._waiters):
            self._loop.call_soon_threadsafe(self._settle_on_loop, outcomes)
