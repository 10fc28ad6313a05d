"""Two-lane token-budget scheduler: packs queued sequences into engine steps, one thread per engine.

ONLINE (queries) has strict priority; BATCH (ingest) fills what is left of each step's
token budget. Each engine gets a worker thread that pipelines: while step N runs, it
builds step N+1 (`engine.prepare`, CPU only) from the work queued when N was launched,
then collects N through its handle and launches N+1; online work that arrives after N+1
was built gets a small step of its own launched just before N+1, so a query waits for at
most the step in flight. With nothing queued, the worker blocks in N's `result()` (on
CUDA an event wait that releases the GIL): it sees N finish at once instead of polling,
and work that arrives meanwhile is built as soon as N is collected. Results reach the
asyncio loop with `call_soon_threadsafe`; the loop never blocks on an engine.
An ONLINE request that finds an asynchronous (CUDA) engine idle is prepared on the event loop
as it is admitted and, when its step would replay a captured graph, launched there too; the
engine's thread is not involved (eager steps and captures, milliseconds of host work, are
left to it). The loop then waits for that step by polling it between its other callbacks
instead of sleeping until a thread wakes it: on a VM each sleep/wake-up costs 0.1-0.3 ms.
Work arriving while that step runs goes to the engine's thread, as for a busy engine: with
several engines, only if no other is less loaded.
Queues are bounded in tokens (QueueFull, or waiting for room on the stream path), and
cancelled or expired work is dropped before it is sent to an engine. With several
engines, an idle one takes new work before a busy one builds ahead (least-loaded first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol, Sequence

import numpy as np

from sidecar.lanes import Chunk, Lane, LaneQueue, Request

log = logging.getLogger("sidecar.scheduler")

# A worker that leaves queued work to a less loaded one (several engines) checks this often
# whether its own step has finished; a change of loads wakes it at once.
_POLL_S = 0.0002

_FAILED = object()  # what an engine call returns here when it raised (its step was failed)


def _replays(prepared: Any) -> bool:
    """For engines without `replays()` (test stand-ins): every launch counts as cheap."""
    return True

__all__ = [
    "Draining",
    "DeadlineExceeded",
    "EngineLike",
    "EngineStats",
    "Lane",
    "LaneStats",
    "QueueFull",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]


class QueueFull(Exception):
    """The lane's queue has no room for the request (gRPC RESOURCE_EXHAUSTED)."""


class Draining(Exception):
    """The scheduler is shutting down and accepts no new work (gRPC UNAVAILABLE)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before all its sequences ran (gRPC DEADLINE_EXCEEDED)."""


# A caller's cancel that lands this close to its request's deadline is counted as the deadline
# (the expiry timer and gRPC's own deadline cancel race on the loop; the 2-core CI box saw either win).
DEADLINE_SLACK_S = 0.005


def _deadline_passed(request: Request) -> DeadlineExceeded:
    """The error of a request whose deadline passed before all its sequences were embedded."""
    return DeadlineExceeded(
        f"deadline passed with {request.remaining} of {request.size} sequences not embedded"
    )


class EngineLike(Protocol):
    """What the scheduler needs from an engine (core_engine.Engine or a test stand-in)."""

    spec: Any  # has .dimensions

    def prepare(self, sequences: Sequence[Sequence[int]]) -> Any: ...

    def step(self, prepared: Any) -> Any: ...  # a handle with .done() and .result()


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budgets and queue bounds, in tokens.

    Defaults are for a GPU with a small encoder (MiniLM-class). Throughput per token is
    flat above about 512 tokens a step, so budgets are set for latency, not throughput:
    a BATCH step of 8,192 tokens takes about 1 ms on an H200, which bounds how long an
    arriving query waits for the step in flight, and a step that carries ONLINE work is
    capped at 2,048 tokens (online first, then batch fill) so the query's own step is
    short too. Measured with these defaults on an H200 (benchmarks/mixed_lanes.py,
    results/mixed_lanes-nvidia-h200.json): batch alone 7.7 M tokens/s; with 200 queries/s
    on top, online p99 2.6 ms and batch 96 % of its solo rate. `for_device("cpu")` scales
    the budgets down: on this project's 2-core CI machine MiniLM runs ~4,300 tokens/s,
    flat from 512 tokens a step (512: 119 ms, 1,024: 238 ms, 128: 35 ms, one thread).
    """

    max_step_tokens: int = 8192  # budget of a step (pure BATCH, or ONLINE alone)
    online_step_tokens: int = 2048  # cap of a step that carries ONLINE work plus batch fill
    max_step_sequences: int = 1024  # sequence slots in one step
    max_queued_tokens_online: int = 65_536  # ONLINE backlog before QueueFull
    max_queued_tokens_batch: int = 262_144  # BATCH backlog before QueueFull / stream waits
    # An ONLINE request that finds an asynchronous (CUDA) engine idle is prepared and launched
    # on the event loop as it is admitted, instead of waking the engine's thread to do it (a
    # wake-up took ~0.1 ms on the H200 host). Env FERN_LAUNCH_ON_ARRIVAL=0 turns it off.
    launch_on_arrival: bool = field(default_factory=lambda: os.environ.get("FERN_LAUNCH_ON_ARRIVAL", "1") != "0")
    # The loop then also waits for that step's result by polling it between its other callbacks
    # for up to this long (then a thread waits): it stays awake instead of sleeping in epoll
    # until a thread wakes it, which cost ~0.1-0.3 ms per query. 0: the engine's thread collects
    # it. Env FERN_ONLINE_POLL_MS.
    online_poll_s: float = field(default_factory=lambda: float(os.environ.get("FERN_ONLINE_POLL_MS", "20")) / 1e3)

    def __post_init__(self) -> None:
        for name in (
            "max_step_tokens",
            "online_step_tokens",
            "max_step_sequences",
            "max_queued_tokens_online",
            "max_queued_tokens_batch",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if not self.online_poll_s >= 0:
            raise ValueError(f"SchedulerConfig.online_poll_s must be >= 0 seconds, got {self.online_poll_s!r}")
        if self.online_step_tokens > self.max_step_tokens:
            raise ValueError(
                f"SchedulerConfig.online_step_tokens ({self.online_step_tokens}) must not exceed "
                f"max_step_tokens ({self.max_step_tokens})"
            )

    @classmethod
    def for_device(cls, device_type: str, **overrides: int) -> SchedulerConfig:
        """Defaults for an engine on `device_type` ("cuda" or "cpu"), with overrides."""
        if device_type == "cpu":
            base = dict(
                max_step_tokens=512,
                online_step_tokens=128,
                max_step_sequences=256,
                max_queued_tokens_online=16_384,
                max_queued_tokens_batch=65_536,
            )
        else:
            base = {}
        base.update(overrides)
        return cls(**base)

    def bound(self, lane: Lane) -> int:
        return self.max_queued_tokens_online if lane == Lane.ONLINE else self.max_queued_tokens_batch


@dataclass(frozen=True)
class LaneStats:
    """A lane's queue depth and how its requests fared, for metrics."""

    queued_tokens: int
    queued_requests: int
    max_queued_tokens: int  # the configured bound
    high_water_tokens: int  # the most tokens ever queued at once
    admitted: int
    rejected: int  # QueueFull
    cancelled: int
    expired: int
    completed: int
    tokens: int  # tokens whose vectors came back (throughput: its rate of change)


@dataclass(frozen=True)
class EngineStats:
    """One engine's work so far."""

    device: str
    steps: int
    tokens: int
    sequences: int
    inflight_tokens: int
    loop_launches: int = 0  # of `steps`, those the event loop launched (launch on arrival)


@dataclass(frozen=True)
class SchedulerStats:
    """Counters for metrics: lanes, engines, totals."""

    online: LaneStats
    batch: LaneStats
    engines: tuple[EngineStats, ...]
    steps: int
    tokens: int
    draining: bool


@dataclass(eq=False)
class _Step:
    """The chunks one engine step carries, in the order of `sequences`."""

    chunks: list[Chunk]
    sequences: list[Sequence[int]]
    tokens: int


@dataclass(eq=False)
class _Waiter:
    """An asyncio task waiting for room in a lane; `request` is set when it waits to be admitted."""

    lane: Lane
    tokens: int
    future: asyncio.Future
    request: Request | None = None


class _Worker:
    """One engine, its thread, and its load (tokens composed and not yet delivered)."""

    def __init__(self, index: int, engine: EngineLike) -> None:
        self.index = index
        self.engine = engine
        self.device = str(getattr(engine, "device", "cpu"))
        self.load = 0
        self.holding = False  # a composed step not yet launched: takes no more work
        self.waiting = False  # idle: nothing in flight, waiting for work
        self.claimed = False  # the event loop is launching a step on this engine (launch on arrival)
        # That step, prepared, and its handle (None: this thread launches it), for this thread to collect.
        self.adopted: tuple[_Step, Any, Any] | None = None
        self.loop_steps = 0  # steps the loop launched on this engine and is waiting for
        self.loop_launches = 0  # steps the loop launched on this engine, ever
        self.steps = 0
        self.tokens = 0
        self.sequences = 0
        self.thread: threading.Thread | None = None

    @property
    def launches_async(self) -> bool:
        """step() returns before the work is done (CUDA): results come later, from result()."""
        return self.device.startswith("cuda")


@dataclass
class _LaneCounters:
    admitted: int = 0
    rejected: int = 0
    cancelled: int = 0
    expired: int = 0
    completed: int = 0
    tokens: int = 0


class Scheduler:
    """Feeds one or more engines from two token-bounded lanes; see the module docstring."""

    def __init__(self, engines: Sequence[EngineLike], config: SchedulerConfig | None = None) -> None:
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        dims = {int(e.spec.dimensions) for e in engines}
        if len(dims) != 1:
            raise ValueError(f"Scheduler engines disagree on dimensions: {sorted(dims)}")
        self.config = config or SchedulerConfig()
        self.dimensions = dims.pop()
        self._workers = [_Worker(i, e) for i, e in enumerate(engines)]
        self._lanes = {lane: LaneQueue(lane, self.config.bound(lane)) for lane in Lane}
        self._counters = {lane: _LaneCounters() for lane in Lane}
        # One lock guards lanes, requests' bookkeeping and worker loads. Idle workers wait on
        # _cond for work; a busy worker that leaves queued work to a less loaded one waits on
        # _loads for loads to change (several engines only).
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._loads = threading.Condition(lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[_Waiter] = deque()  # loop thread only
        self._live: set[Request] = set()  # admitted, not yet settled; loop thread only
        self._drained: asyncio.Event | None = None
        self._collecting: set[asyncio.Task] = set()  # steps the loop launched and waits for
        self._draining = False
        self._stopping = False
        self._steps = 0
        self._tokens = 0

    # ------------------------------------------------------------------ asyncio side

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

    async def embed(
        self,
        sequences: Sequence[Sequence[int]],
        lane: Lane = Lane.ONLINE,
        deadline: float | None = None,
        *,
        wait: bool = False,
    ) -> np.ndarray:
        """Embed token-id sequences; returns float32 [N, D] raw pooled vectors in input order.

        Raises QueueFull at once when the lane has no room (with `wait=True` it waits its
        turn for room instead, FIFO with other waiters: the stream path), Draining after
        `drain()`, DeadlineExceeded when `deadline` (time.monotonic()) passes first.
        Cancelling the awaiting task drops its sequences that have not reached an engine.
        """
        lane = Lane(lane)
        self._check_open()
        request = self._new_request(sequences, lane, deadline)
        if request.size == 0:
            return request.out
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
                waiter = _Waiter(lane, tokens, self._loop.create_future(), request)
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
        waiter = _Waiter(lane, tokens, self._loop.create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._forget_waiter(waiter)
            raise

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
        # (_next_step): one wake-up is enough.
        self._cond.notify()
        self._loads.notify_all()

    def _claim_locked(self) -> tuple[_Worker, _Step] | None:
        """An idle asynchronous engine and an online step composed for it, or None (lock held).

        The step takes online work only, within the budget of an online-only step (as the
        engine's thread would compose it): a batch step's host work does not belong on the loop.
        """
        worker = next((w for w in self._workers if w.waiting and w.launches_async
                       and not w.claimed and w.adopted is None and not w.loop_steps), None)
        if worker is None:
            return None
        step = self._online_step_locked(worker, self.config.max_step_tokens)
        if step is None:
            return None
        worker.claimed = True
        return worker, step

    def _launch_on_loop(self, worker: _Worker, step: _Step) -> None:
        """Prepare a claimed step here and launch it if that is cheap; then collect it here too.

        A step that would not replay a captured graph (an eager step or a capture: milliseconds
        of host work for a new shape) is handed to the engine's thread to launch, off the loop;
        so is a launched step when `online_poll_s` is 0.
        """
        engine = worker.engine
        adopted = None
        try:
            prepared = self._call(worker, step, engine.prepare, step.sequences)
            if prepared is _FAILED:
                return
            cheap = self._call(worker, step, getattr(engine, "replays", _replays), prepared)
            if cheap is _FAILED:
                return
            handle = self._call(worker, step, engine.step, prepared) if cheap else None
            if handle is _FAILED:
                return
            if handle is None:
                adopted = (step, prepared, None)  # the engine's thread launches it
                return
            self._launched(worker, step, by_loop=True)
            if self.config.online_poll_s > 0:
                with self._cond:
                    worker.loop_steps += 1  # busy: work arriving meanwhile goes to its thread
                task = self._loop.create_task(self._collect_on_loop(worker, step, handle))
                self._collecting.add(task)
                task.add_done_callback(self._collecting.discard)
            else:
                adopted = (step, prepared, handle)
        finally:  # whatever happened, the claim ends; the engine's thread is woken only if it has work
            with self._cond:
                worker.claimed = False
                worker.adopted = adopted
                if adopted is not None or self._has_work_locked():
                    self._cond.notify_all()

    async def _collect_on_loop(self, worker: _Worker, step: _Step, handle: Any) -> None:
        """Wait for a step the loop launched, polling it between the loop's other callbacks, and deliver it.

        A step still running after `online_poll_s` is waited for on a thread instead. The task is
        not the caller's: a cancelled request does not stop it (its step may carry other requests).
        """
        give_up = time.monotonic() + self.config.online_poll_s
        try:
            while True:
                done = self._call(worker, step, handle.done)
                if done is _FAILED:
                    return
                if done:
                    rows = self._call(worker, step, handle.result)
                    break
                if time.monotonic() > give_up:
                    rows = await asyncio.to_thread(self._call, worker, step, handle.result)
                    break
                await asyncio.sleep(0)
        finally:
            with self._cond:
                worker.loop_steps -= 1
        if rows is not _FAILED:
            self._deliver(worker, step, rows, on_loop=True)

    def _expire(self, request: Request) -> None:
        self._drop(request, _deadline_passed(request))

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
                    future.set_result(request.out)
            else:
                future.set_exception(error)
        self._live.discard(request)
        if not self._live and self._drained is not None:
            self._drained.set()

    def _settle_on_loop(self, outcomes: list[tuple[Request, BaseException | None]]) -> None:
        for request, error in outcomes:
            self._finish(request, error)
        self._wake_waiters()

    def _forget_waiter(self, waiter: _Waiter) -> None:
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

    # ------------------------------------------------------------------ worker threads

    def _work(self, worker: _Worker) -> None:
        """The pipeline: build N+1 while N runs, collect N, launch N+1.

        If online work arrived after N+1 was built without it, a small online-only step
        is launched just before N+1, so the query waits only for the step that was in
        flight and the big prepared step is not rebuilt. On an asynchronous (CUDA) engine
        N+1 is launched before N's results are handed out, so the device idles as little
        as possible; on a synchronous one (CPU, where step() computes) N is handed out
        first, or its callers would wait for N+1 as well.
        """
        launch_first = worker.launches_async
        in_flight: deque[tuple[_Step, Any]] = deque()
        while True:
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
            prepared: Any = _FAILED
            if nxt is not None:
                prepared = self._call(worker, nxt, worker.engine.prepare, nxt.sequences)
                if prepared is _FAILED:
                    nxt = None
            waited = bool(in_flight)
            deferred: tuple[_Step, np.ndarray] | None = None
            while in_flight:  # oldest first: a jump step's online results go out first
                step, handle = in_flight.popleft()
                rows = self._call(worker, step, handle.result)
                if rows is _FAILED:
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
            if nxt is not None:
                self._launch(worker, nxt, prepared, in_flight)
            if deferred is not None:
                self._deliver(worker, *deferred)

    def _launch(self, worker: _Worker, step: _Step, prepared: Any, in_flight: deque) -> None:
        """Prepare (when `prepared` is None) and start a step; a failure fails its requests."""
        if prepared is None:
            prepared = self._call(worker, step, worker.engine.prepare, step.sequences)
            if prepared is _FAILED:
                return
        handle = self._call(worker, step, worker.engine.step, prepared)
        if handle is not _FAILED:
            self._launched(worker, step)
            in_flight.append((step, handle))

    def _next_step(self, worker: _Worker, *, in_flight: Any) -> _Step | None:
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

    def _wait_idle_locked(self, worker: _Worker) -> None:
        """Wait for work with nothing in flight: the loop may claim this engine meanwhile (lock held)."""
        worker.waiting = True
        try:
            self._cond.wait()
        finally:
            worker.waiting = False

    def _finished(self, worker: _Worker, handle: Any) -> bool:
        """Whether a step in flight is done; one whose done() raises counts as done (lock held).

        Its result() then answers for it, through `_call`: failing the step here would take
        the lock again.
        """
        try:
            return bool(handle.done())
        except Exception:
            log.exception("engine %d (%s): done() failed; collecting the step", worker.index, worker.device)
            return True

    def _has_work_locked(self) -> bool:
        return any(q.has_work() for q in self._lanes.values())

    def _least_loaded_locked(self, worker: _Worker) -> bool:
        """A worker with a step in flight takes more only if no free worker has less load."""
        return all(
            worker.load <= other.load
            for other in self._workers
            if other is not worker and not other.holding
        )

    def _compose_locked(self, worker: _Worker) -> _Step | None:
        cfg = self.config
        now = time.monotonic()
        online = self._lanes[Lane.ONLINE].take(
            cfg.max_step_tokens, cfg.max_step_sequences, now, oversize_ok=True
        )
        batch_budget = max(0, cfg.online_step_tokens - online.tokens) if online.chunks else cfg.max_step_tokens
        batch = self._lanes[Lane.BATCH].take(
            batch_budget,
            cfg.max_step_sequences - online.sequences,
            now,
            oversize_ok=not online.chunks,
        )
        outcomes = self._expire_locked(online.expired + batch.expired)
        chunks = online.chunks + batch.chunks
        self._post(outcomes, room_freed=True)
        if not chunks:
            return None
        return self._new_step_locked(worker, chunks, online.tokens + batch.tokens)

    def _new_step_locked(self, worker: _Worker, chunks: list[Chunk], tokens: int) -> _Step:
        sequences: list[Sequence[int]] = []
        for chunk in chunks:
            sequences.extend(chunk.request.sequences[chunk.start : chunk.end])
        worker.load += tokens
        worker.holding = True
        return _Step(chunks, sequences, tokens)

    def _expire_locked(self, requests: list[Request]) -> list[tuple[Request, BaseException | None]]:
        outcomes = []
        for request in requests:
            if request.settled:
                continue
            request.settled = True
            request.dropped = True
            self._counters[request.lane].expired += 1
            outcomes.append((request, _deadline_passed(request)))
        return outcomes

    def _revalidate(self, worker: _Worker, step: _Step, prepared: Any) -> tuple[_Step | None, Any]:
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
            return None, _FAILED
        prepared = self._call(worker, fresh, worker.engine.prepare, fresh.sequences)
        return (fresh, prepared) if prepared is not _FAILED else (None, _FAILED)

    def _jump_step(self, worker: _Worker, step: _Step) -> _Step | None:
        """An online-only step to run before `step`, for online work that came after it was built.

        Only when `step` carries no online work: otherwise newer queries would overtake
        older ones, and they wait for `step`, which is short (an online step's budget).
        """
        with self._cond:
            if any(c.request.lane == Lane.ONLINE for c in step.chunks):
                return None
            if not self._lanes[Lane.ONLINE].has_work():
                return None
            return self._online_step_locked(worker, self.config.online_step_tokens)

    def _online_step_locked(self, worker: _Worker, budget: int) -> _Step | None:
        """A step of queued online work only, up to `budget` tokens; None if none is left (lock held)."""
        took = self._lanes[Lane.ONLINE].take(
            budget, self.config.max_step_sequences, time.monotonic(), oversize_ok=True
        )
        self._post(self._expire_locked(took.expired), room_freed=True)
        if not took.chunks:
            return None
        return self._new_step_locked(worker, took.chunks, took.tokens)

    def _call(self, worker: _Worker, step: _Step, call: Any, *args: Any) -> Any:
        """Run an engine call for `step`; if it raises, fail the step's requests with that error."""
        try:
            return call(*args)
        except Exception as error:  # goes to every caller whose sequences were in the step
            log.exception("engine %d (%s) failed a step of %d tokens", worker.index, worker.device, step.tokens)
            self._fail(worker, step, error)
            return _FAILED

    def _launched(self, worker: _Worker, step: _Step, *, by_loop: bool = False) -> None:
        with self._cond:
            worker.loop_launches += by_loop
            worker.holding = False
            worker.steps += 1
            worker.tokens += step.tokens
            worker.sequences += len(step.sequences)
            self._steps += 1
            self._tokens += step.tokens

    def _fail(self, worker: _Worker, step: _Step, error: Exception) -> None:
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

    def _deliver(self, worker: _Worker, step: _Step, rows: np.ndarray, *, on_loop: bool = False) -> None:
        """Copy a finished step's rows into their requests; post the requests now complete
        (settle them at once when called on the loop)."""
        outcomes: list[tuple[Request, BaseException | None]] = []
        with self._cond:
            worker.load -= step.tokens
            offset = 0
            for chunk in step.chunks:
                request = chunk.request
                n = chunk.size
                if not request.dropped:
                    request.out[chunk.start : chunk.end] = rows[offset : offset + n]
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
