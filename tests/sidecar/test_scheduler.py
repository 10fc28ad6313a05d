"""Two-lane scheduler behaviour against an engine stand-in whose steps the test releases."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Awaitable, Callable, Sequence

import numpy as np
import pytest

from sidecar.scheduler import (
    DEADLINE_SLACK_S,
    DeadlineExceeded,
    Draining,
    Lane,
    QueueFull,
    Scheduler,
    SchedulerConfig,
)

DIMS = 4
ONLINE_MARK = 1  # first id of every online test sequence, so a step's lanes are visible
BATCH_MARK = 2


def expected(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """The stand-in's vector for each sequence: a function of its ids, checkable in tests."""
    return np.array([[sum(s), len(s), s[0], s[-1]] for s in seqs], dtype=np.float32).reshape(-1, DIMS)


class Handle:
    def __init__(self, engine: "GatedEngine", rows: np.ndarray) -> None:
        self._engine = engine
        self._rows = rows
        self._collected = False

    def done(self) -> bool:
        self._engine.done_calls += 1
        if self._engine.fail_done:
            self._engine.raise_here("done")
        return self._collected or self._engine.permits > 0

    def result(self) -> np.ndarray:
        if self._engine.fail_result:
            self._engine.raise_here("result")
        if not self._collected:
            self._engine.take_permit()
            self._collected = True
        return self._rows


class GatedEngine:
    """Engine stand-in: step() returns at once (like CUDA); result() waits for release()."""

    def __init__(self, *, gated: bool = True, name: str = "fake:0", fail_prepare: bool = False) -> None:
        self.spec = SimpleNamespace(dimensions=DIMS)
        self.device = name
        self.prepared: list[list[tuple[int, ...]]] = []
        self.stepped: list[list[tuple[int, ...]]] = []
        self.fail_prepare = fail_prepare
        self.cheap_launches: int | None = None  # set: replays() answers True this many times, then False
        self.fail_replays = False
        self.fail_step = False  # step() raises
        self.fail_done = False  # a handle's done() raises
        self.fail_result = False  # a handle's result() raises
        self.permits = 10**9 if not gated else 0  # steps allowed to finish
        self.done_calls = 0  # how often the scheduler asked a handle whether its step was done
        self.waiting = 0  # threads inside result(), waiting for a step to be released
        self.launching = threading.Event()  # set while step() is held by hold_launch()
        self._launch_gate: threading.Event | None = None
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self.threads: list[tuple[str, str]] = []  # (call, thread name) of each prepare/step
        self._in_call = 0
        self.overlapped = False  # two threads were inside prepare/step at once
        self.raised_in: list[tuple[str, str]] = []  # (call, thread name) of each failure raised by fail_*
        self._holds: dict[str, tuple[int, threading.Event]] = {}  # call -> (calls let through, gate)

    def raise_here(self, call: str) -> None:
        with self._lock:
            self.raised_in.append((call, threading.current_thread().name))
        raise RuntimeError(f"engine stand-in: {call} failed")

    def _enter(self, call: str) -> None:
        with self._lock:
            self.threads.append((call, threading.current_thread().name))
            self._in_call += 1
            self.overlapped |= self._in_call > 1

    def _leave(self) -> None:
        with self._lock:
            self._in_call -= 1

    def release(self, steps: int = 1) -> None:
        with self._released:
            self.permits += steps
            self._released.notify_all()

    def hold_launch(self) -> threading.Event:
        """The next step() waits until the returned event is set: work queued meanwhile is
        queued when the step is launched."""
        self._launch_gate = threading.Event()
        return self._launch_gate

    def hold_after(self, call: str, count: int) -> threading.Event:
        """Every `call` ("prepare" or "step") after the first `count` waits, inside the call,
        until the returned event is set."""
        gate = threading.Event()
        self._holds[call] = (count, gate)
        return gate

    def _held(self, call: str, made: int) -> None:
        count, gate = self._holds.get(call, (made, None))
        if gate is not None and made > count and not gate.wait(timeout=30):
            raise TimeoutError(f"the test never let {call} #{made} go on")

    def take_permit(self) -> None:
        with self._released:
            self.waiting += 1
            try:
                if not self._released.wait_for(lambda: self.permits > 0, timeout=10):
                    raise TimeoutError("the test never released this step")
            finally:
                self.waiting -= 1
            self.permits -= 1

    def prepare(self, sequences: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        self._enter("prepare")
        try:
            batch = [tuple(s) for s in sequences]
            with self._lock:
                self.prepared.append(batch)
                made = len(self.prepared)
            self._held("prepare", made)
            time.sleep(0.0002)  # long enough for another thread to collide, were it allowed in
            if self.fail_prepare:
                raise RuntimeError("engine stand-in: prepare failed")
            return batch
        finally:
            self._leave()

    def replays(self, prepared: list[tuple[int, ...]]) -> bool:
        """Whether step() would be a cheap launch (the engine's graph replay); the loop only launches those."""
        if self.fail_replays:
            raise RuntimeError("engine stand-in: replays failed")
        if self.cheap_launches is None:
            return True
        self.cheap_launches -= 1
        return self.cheap_launches >= 0

    def step(self, prepared: list[tuple[int, ...]]) -> Handle:
        self._enter("step")
        try:
            if self.fail_step:
                self.raise_here("step")
            with self._lock:
                self.stepped.append(prepared)
                made = len(self.stepped)
            self._held("step", made)
            gate, self._launch_gate = self._launch_gate, None
            if gate is not None:
                self.launching.set()
                if not gate.wait(timeout=10):
                    raise TimeoutError("the test never let this step launch")
            return Handle(self, expected(prepared))
        finally:
            self._leave()

    def stepped_ids(self) -> set[tuple[int, ...]]:
        with self._lock:
            return {s for step in self.stepped for s in step}


# A device name starting with "cuda" makes the scheduler launch the next step before it
# hands out the last one's results (asynchronous engines); others hand out first.
ASYNC_AND_SYNC = pytest.mark.parametrize("device", ["cpu:fake", "cuda:fake"])


def run(coro: Awaitable, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    stop = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > stop:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


def texts(mark: int, start: int, count: int, length: int = 8) -> list[list[int]]:
    """`count` distinct sequences: [mark, serial, filler...] of `length` tokens."""
    return [[mark, start + i] + [7] * (length - 2) for i in range(count)]


def config(**overrides: int) -> SchedulerConfig:
    base = dict(
        max_step_tokens=64,
        online_step_tokens=32,
        max_step_sequences=64,
        max_queued_tokens_online=10_000,
        max_queued_tokens_batch=200_000,
    )
    base.update(overrides)
    base["online_step_tokens"] = min(base["online_step_tokens"], base["max_step_tokens"])
    return SchedulerConfig(**base)


@ASYNC_AND_SYNC
def test_online_behind_10000_batch_texts_runs_in_the_next_step(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=512, online_step_tokens=128))
        await sched.start()
        batch = [
            asyncio.create_task(sched.embed(texts(BATCH_MARK, i * 100, 100), Lane.BATCH))
            for i in range(100)
        ]  # 10,000 texts, 80,000 tokens
        await until(lambda: len(engine.stepped) == 1 and len(engine.prepared) == 2)
        query = texts(ONLINE_MARK, 0, 3, length=12)
        online = asyncio.create_task(sched.embed(query, Lane.ONLINE))
        await asyncio.sleep(0.01)
        engine.release(1)  # step 1, in flight when the query came, finishes
        await until(lambda: len(engine.stepped) >= 2)
        # The very next step carries the query (alone: the prepared batch step runs after it).
        assert engine.stepped[1] == [tuple(q) for q in query]
        engine.release(1)
        vectors = await online
        np.testing.assert_array_equal(vectors, expected(query))
        assert sched.stats().batch.queued_tokens > 70_000  # batch still waiting: priority, not luck
        engine.release(10**6)
        results = await asyncio.gather(*batch)
        for i, got in enumerate(results):
            np.testing.assert_array_equal(got, expected(texts(BATCH_MARK, i * 100, 100)))
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_a_query_behind_a_step_in_flight_is_answered_before_the_next_batch_step_is_built(device):
    """The query's own (jump) step is collected and handed out before the engine thread builds
    the next batch step, and on a synchronous engine before it computes the batch step it
    jumped: neither waits for that bulk work."""
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=512, online_step_tokens=128))
        await sched.start()
        batch = [asyncio.create_task(sched.embed(texts(BATCH_MARK, i * 100, 100), Lane.BATCH))
                 for i in range(20)]
        await until(lambda: len(engine.stepped) == 1 and len(engine.prepared) == 2)
        # Prepares 1 and 2 are batch steps, 3 the query's; whatever comes later waits for the gate.
        gates = [engine.hold_after("prepare", 3)]
        if device.startswith("cpu"):  # steps 1 and 2: the first batch step and the query's
            gates.append(engine.hold_after("step", 2))
        query = texts(ONLINE_MARK, 0, 3, length=12)
        online = asyncio.create_task(sched.embed(query, Lane.ONLINE))
        await until(lambda: sched.stats().online.queued_tokens > 0)
        engine.release(2)  # the step in flight when the query came, then the query's own
        vectors = await asyncio.wait_for(asyncio.shield(online), 10)
        np.testing.assert_array_equal(vectors, expected(query))
        assert engine.stepped[1] == [tuple(q) for q in query]
        for gate in gates:
            gate.set()
        engine.release(10**6)
        results = await asyncio.gather(*batch)
        for i, got in enumerate(results):
            np.testing.assert_array_equal(got, expected(texts(BATCH_MARK, i * 100, 100)))
        await sched.drain()

    run(main(), timeout=60)


@ASYNC_AND_SYNC
def test_fcfs_within_each_lane(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config())
        await sched.start()
        first = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(lambda: len(engine.stepped) == 1)
        order = [texts(BATCH_MARK, 100 * k, 5, length=3 + k) for k in range(1, 6)]
        online_order = [texts(ONLINE_MARK, 100 * k, 3, length=2 + k) for k in range(1, 4)]
        tasks = []
        for k in range(5):
            tasks.append(asyncio.create_task(sched.embed(order[k], Lane.BATCH)))
            if k < 3:
                tasks.append(asyncio.create_task(sched.embed(online_order[k], Lane.ONLINE)))
        await asyncio.sleep(0.01)
        engine.release(10**6)
        await asyncio.gather(first, *tasks)
        seen = [s for step in engine.stepped[1:] for s in step]
        seen_batch = [s for s in seen if s[0] == BATCH_MARK]
        seen_online = [s for s in seen if s[0] == ONLINE_MARK]
        assert seen_batch == [tuple(s) for req in order for s in req]
        assert seen_online == [tuple(s) for req in online_order for s in req]
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_a_late_query_never_overtakes_an_earlier_one(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=64, online_step_tokens=32))
        await sched.start()
        launch = engine.hold_launch()
        head = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 8), Lane.BATCH))
        await until(engine.launching.is_set)
        first = texts(ONLINE_MARK, 0, 1)
        tasks = [asyncio.create_task(sched.embed(first, Lane.ONLINE)),
                 asyncio.create_task(sched.embed(texts(BATCH_MARK, 100, 8), Lane.BATCH))]
        await until(lambda: sched.stats().batch.queued_requests == 1)  # both queued at the launch
        launch.set()
        await until(lambda: len(engine.prepared) == 2)  # `first` + batch fill, built ahead
        late = texts(ONLINE_MARK, 10, 1)
        tasks.append(asyncio.create_task(sched.embed(late, Lane.ONLINE)))
        await asyncio.sleep(0.01)
        engine.release(10**6)
        await asyncio.gather(head, *tasks)
        online_order = [s for step in engine.stepped for s in step if s[0] == ONLINE_MARK]
        assert online_order == [tuple(first[0]), tuple(late[0])]
        assert engine.stepped[1][0] == tuple(first[0])
        assert engine.stepped[2][0] == tuple(late[0])  # and it waited for one short step only
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_a_step_in_flight_with_nothing_queued_is_awaited_and_later_work_goes_in_one_step(device):
    async def main():
        engine = GatedEngine(name=device)
        # The engine thread's own wait (the loop's wait for its own launches is tested below).
        sched = Scheduler([engine], config(max_step_tokens=64, online_step_tokens=32, online_poll_s=0.0))
        await sched.start()
        head = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE))
        # Nothing queued: the worker waits in the step's result() (an event wait on CUDA,
        # without the GIL), not in a loop that asks done() over and over.
        await until(lambda: engine.waiting == 1)
        assert engine.done_calls == 0
        queries = [texts(ONLINE_MARK, 10 + i, 1) for i in range(3)]
        tasks = [asyncio.create_task(sched.embed(q, Lane.ONLINE)) for q in queries]
        await until(lambda: sched.stats().online.queued_requests == 3)
        engine.release(10**6)
        np.testing.assert_array_equal(await head, expected(texts(ONLINE_MARK, 0, 1)))
        for q, task in zip(queries, tasks):
            np.testing.assert_array_equal(await task, expected(q))
        # What arrived while the step ran is built once it is collected, all in the next step.
        assert engine.stepped[1] == [tuple(q[0]) for q in queries]
        assert len(engine.stepped) == 2
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_every_step_respects_the_budgets(device):
    rng = np.random.default_rng(7)

    async def main():
        engine = GatedEngine(gated=False, name=device)
        cfg = config(max_step_tokens=100, online_step_tokens=40, max_step_sequences=9)
        sched = Scheduler([engine], cfg)
        await sched.start()
        tasks = []
        for i in range(150):
            lane = Lane.ONLINE if rng.random() < 0.3 else Lane.BATCH
            mark = ONLINE_MARK if lane == Lane.ONLINE else BATCH_MARK
            seqs = [[mark, i] + [5] * int(rng.integers(0, 30)) for _ in range(int(rng.integers(1, 12)))]
            tasks.append((seqs, asyncio.create_task(sched.embed(seqs, lane))))
            if i % 10 == 0:
                await asyncio.sleep(0)
        for seqs, task in tasks:
            np.testing.assert_array_equal(await task, expected(seqs))
        await sched.drain()
        for step in engine.stepped:
            total = sum(len(s) for s in step)
            online = sum(len(s) for s in step if s[0] == ONLINE_MARK)
            assert total <= cfg.max_step_tokens
            assert len(step) <= cfg.max_step_sequences
            if online and total > online:  # batch filled a step that carries online work
                assert total <= cfg.online_step_tokens
        assert sched.stats().tokens == sum(len(s) for step in engine.stepped for s in step)

    run(main())


@ASYNC_AND_SYNC
def test_large_request_is_split_and_reassembled_in_input_order(device):
    async def main():
        engine = GatedEngine(gated=False, name=device)
        sched = Scheduler([engine], config(max_step_tokens=64, max_step_sequences=16))
        await sched.start()
        rng = np.random.default_rng(3)
        seqs = [[BATCH_MARK, i] + [9] * int(rng.integers(0, 40)) for i in range(300)]
        seqs.append([BATCH_MARK, 999] + [9] * 200)  # longer than a whole step: runs alone
        got = await sched.embed(seqs, Lane.BATCH)
        np.testing.assert_array_equal(got, expected(seqs))
        assert len(engine.stepped) >= sum(len(s) for s in seqs) / 64
        assert [tuple(seqs[-1])] in engine.stepped
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_cancelled_work_never_reaches_the_engine(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=16))
        await sched.start()
        head = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        prefetched = texts(BATCH_MARK, 100, 2)
        queued = texts(BATCH_MARK, 200, 6)
        t_pre = asyncio.create_task(sched.embed(prefetched, Lane.BATCH))
        t_queued = asyncio.create_task(sched.embed(queued, Lane.BATCH))
        # Step 1 runs `head`; step 2 (prepared while 1 runs) holds `prefetched`.
        await until(lambda: len(engine.stepped) == 1 and len(engine.prepared) == 2)
        assert engine.prepared[1] == [tuple(s) for s in prefetched]
        t_pre.cancel()
        t_queued.cancel()
        await asyncio.sleep(0.01)
        assert sched.stats().batch.queued_tokens == 0
        engine.release(10**6)
        await head
        for t in (t_pre, t_queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        after = asyncio.create_task(sched.embed(texts(BATCH_MARK, 300, 1), Lane.BATCH))
        await after
        stepped = engine.stepped_ids()
        assert not stepped & {tuple(s) for s in prefetched + queued}
        assert sched.stats().batch.cancelled == 2
        await sched.drain()

    run(main())


def test_a_cancel_at_the_deadline_counts_as_expired_and_one_before_it_as_cancelled():
    # gRPC cancels a call at its deadline at about the moment the scheduler's expiry timer fires:
    # either way round, the drain log and /metrics must say it expired.
    async def main():
        engine = GatedEngine(name="cpu")
        sched = Scheduler([engine], config(max_step_tokens=16))
        await sched.start()
        head = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(lambda: len(engine.stepped) == 1)
        at_deadline = asyncio.create_task(
            sched.embed(texts(BATCH_MARK, 100, 1), Lane.BATCH, deadline=time.monotonic() + DEADLINE_SLACK_S / 4))
        early = asyncio.create_task(sched.embed(texts(BATCH_MARK, 200, 1), Lane.BATCH, deadline=time.monotonic() + 60))
        await asyncio.sleep(0)  # both are queued behind the gated step
        at_deadline.cancel()
        early.cancel()
        for task in (at_deadline, early):
            with pytest.raises(asyncio.CancelledError):
                await task
        stats = sched.stats().batch
        assert (stats.expired, stats.cancelled) == (1, 1)
        engine.release(10**6)
        await head
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_expired_work_is_dropped_before_the_engine(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=16))
        await sched.start()
        launch = engine.hold_launch()
        head = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(engine.launching.is_set)
        # One request expires while prepared for the next step, one while queued behind it.
        prefetched = texts(BATCH_MARK, 100, 2)
        queued = texts(ONLINE_MARK, 0, 2)
        t_pre = asyncio.create_task(
            sched.embed(prefetched, Lane.BATCH, deadline=time.monotonic() + 0.05)
        )
        await until(lambda: sched.stats().batch.queued_requests == 1)
        launch.set()
        await until(lambda: len(engine.prepared) == 2)
        assert engine.prepared[1] == [tuple(s) for s in prefetched]
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await sched.embed(queued, Lane.ONLINE, deadline=time.monotonic() + 0.05)
        assert time.monotonic() - started < 1.0  # the caller hears at the deadline, not later
        with pytest.raises(DeadlineExceeded):
            await t_pre
        with pytest.raises(DeadlineExceeded):
            await sched.embed(queued, Lane.ONLINE, deadline=time.monotonic() - 1)
        engine.release(10**6)
        await head
        ok = await sched.embed(texts(ONLINE_MARK, 50, 1), Lane.ONLINE, deadline=time.monotonic() + 5)
        np.testing.assert_array_equal(ok, expected(texts(ONLINE_MARK, 50, 1)))
        assert not engine.stepped_ids() & {tuple(s) for s in prefetched + queued}
        stats = sched.stats()
        assert (stats.online.expired, stats.batch.expired) == (2, 1)
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_queue_full_at_the_bound_and_wait_for_room_unblocks(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=16, max_queued_tokens_batch=100))
        await sched.start()
        launch = engine.hold_launch()
        r1 = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(engine.launching.is_set)
        r2 = asyncio.create_task(sched.embed(texts(BATCH_MARK, 10, 2), Lane.BATCH))
        await until(lambda: sched.stats().batch.queued_requests == 1)
        launch.set()
        await until(lambda: len(engine.prepared) == 2)
        r3 = asyncio.create_task(sched.embed(texts(BATCH_MARK, 20, 10, length=10), Lane.BATCH))
        await asyncio.sleep(0)
        assert sched.stats().batch.queued_tokens == 100
        with pytest.raises(QueueFull, match="BATCH queue is full"):
            await sched.embed(texts(BATCH_MARK, 40, 1, length=2), Lane.BATCH)
        with pytest.raises(QueueFull, match="whole queue bound"):
            await sched.embed(texts(BATCH_MARK, 40, 1, length=101), Lane.BATCH)
        # ONLINE has its own bound: still open.
        online = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE))
        room = asyncio.create_task(sched.wait_for_room(Lane.BATCH, 30))
        queued_wait = asyncio.create_task(
            sched.embed(texts(BATCH_MARK, 60, 1, length=50), Lane.BATCH, wait=True)
        )
        await asyncio.sleep(0.05)
        assert not room.done() and not queued_wait.done()
        engine.release(10**6)
        await asyncio.wait_for(room, 5)
        got = await asyncio.wait_for(queued_wait, 5)
        np.testing.assert_array_equal(got, expected(texts(BATCH_MARK, 60, 1, length=50)))
        await asyncio.gather(r1, r2, r3, online)
        stats = sched.stats()
        assert stats.batch.high_water_tokens <= 100
        assert stats.batch.rejected == 2
        await sched.drain()

    run(main())


@ASYNC_AND_SYNC
def test_drain_finishes_in_flight_and_rejects_new(device):
    async def main():
        engine = GatedEngine(name=device)
        sched = Scheduler([engine], config(max_step_tokens=16))
        await sched.start()
        work = [texts(BATCH_MARK, 10 * i, 3) for i in range(6)]
        tasks = [asyncio.create_task(sched.embed(w, Lane.BATCH)) for w in work]
        await until(lambda: len(engine.stepped) == 1)
        drain = asyncio.create_task(sched.drain())
        await asyncio.sleep(0.01)
        assert not drain.done()
        with pytest.raises(Draining):
            await sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE)
        with pytest.raises(Draining):
            await sched.wait_for_room(Lane.BATCH, 1)
        engine.release(10**6)
        await asyncio.wait_for(drain, 5)
        for w, t in zip(work, tasks):
            np.testing.assert_array_equal(t.result(), expected(w))
        assert all(not w.thread.is_alive() for w in sched._workers)  # noqa: SLF001

    run(main())


def test_idle_engine_gets_work_before_a_busy_one_and_a_stalled_engine_is_bypassed():
    async def main():
        engines = [GatedEngine(name="fake:0"), GatedEngine(name="fake:1")]
        sched = Scheduler(engines, config(max_step_tokens=16))
        await sched.start()
        first = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(lambda: sum(len(e.stepped) for e in engines) == 1)
        busy = next(e for e in engines if e.stepped)
        free = next(e for e in engines if not e.stepped)
        second = asyncio.create_task(sched.embed(texts(BATCH_MARK, 10, 2), Lane.BATCH))
        await until(lambda: len(free.stepped) == 1)
        assert len(busy.prepared) == 1  # the busy engine did not take it as a prefetch
        # `busy` stays stalled: it may hold one prepared step behind the one it runs
        # (the pipeline), and everything else flows through `free`.
        free.release(10**6)
        rest = [texts(BATCH_MARK, 100 + 10 * i, 2) for i in range(20)]
        tasks = [asyncio.create_task(sched.embed(r, Lane.BATCH)) for r in rest]
        await until(lambda: sum(t.done() for t in tasks) >= len(rest) - 1)
        assert len(busy.prepared) <= 2 and len(busy.stepped) == 1
        stats = sched.stats()
        assert [e.device for e in stats.engines] == ["fake:0", "fake:1"]
        assert stats.engines[engines.index(busy)].inflight_tokens >= 16
        busy.release(10**6)
        results = await asyncio.gather(first, second, *tasks)
        for r, got in zip(rest, results[2:]):
            np.testing.assert_array_equal(got, expected(r))
        assert len(busy.stepped) <= 2
        await sched.drain()

    run(main())


def test_an_engine_whose_done_raises_while_it_leaves_work_to_a_less_loaded_one_keeps_serving():
    async def main():
        engines = [GatedEngine(name="fake:0"), GatedEngine(name="fake:1")]
        gates = [e.hold_launch() for e in engines]
        sched = Scheduler(engines, config(max_step_tokens=16))
        await sched.start()
        big = [[BATCH_MARK, 0] + [7] * 38]  # 40 tokens: a step of its own
        first = asyncio.create_task(sched.embed(big, Lane.BATCH))
        await until(lambda: any(e.launching.is_set() for e in engines))
        busy = next(e for e in engines if e.launching.is_set())
        free = next(e for e in engines if e is not busy)
        second = asyncio.create_task(sched.embed(texts(BATCH_MARK, 10, 1), Lane.BATCH))
        await until(free.launching.is_set)
        gates[engines.index(free)].set()
        await until(lambda: free.waiting == 1)  # in its step's result(), nothing queued
        third = asyncio.create_task(sched.embed(texts(BATCH_MARK, 20, 1), Lane.BATCH))
        await until(lambda: sched.stats().batch.queued_requests == 1)
        # `busy` (40 tokens in flight) leaves the queued work to `free` (8) and watches its
        # own step meanwhile: that done() raises.
        busy.fail_done = True
        gates[engines.index(busy)].set()
        await until(lambda: busy.raised_in)
        assert busy.raised_in[0][0] == "done" and busy.raised_in[0][1].startswith("fern-engine-")
        for e in engines:
            e.release(10**6)
        got = await asyncio.wait_for(asyncio.gather(first, second, third), 5)
        for seqs, rows in zip([big, texts(BATCH_MARK, 10, 1), texts(BATCH_MARK, 20, 1)], got):
            np.testing.assert_array_equal(rows, expected(seqs))
        assert all(w.thread.is_alive() for w in sched._workers)  # noqa: SLF001
        assert all(e.inflight_tokens == 0 for e in sched.stats().engines)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


def test_engine_failure_fails_its_requests_and_serving_goes_on():
    async def main():
        engine = GatedEngine(gated=False, fail_prepare=True)
        sched = Scheduler([engine], config())
        await sched.start()
        with pytest.raises(RuntimeError, match="prepare failed"):
            await sched.embed(texts(ONLINE_MARK, 0, 2), Lane.ONLINE)
        engine.fail_prepare = False
        got = await sched.embed(texts(ONLINE_MARK, 5, 2), Lane.ONLINE)
        np.testing.assert_array_equal(got, expected(texts(ONLINE_MARK, 5, 2)))
        assert sched.stats().online.queued_tokens == 0
        await sched.drain()

    run(main())


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="online_step_tokens"):
        SchedulerConfig(max_step_tokens=64, online_step_tokens=128)
    with pytest.raises(ValueError, match="max_queued_tokens_batch"):
        SchedulerConfig(max_queued_tokens_batch=0)

    async def main():
        sched = Scheduler([GatedEngine(gated=False)], config())
        await sched.start()
        with pytest.raises(ValueError, match=r"sequences\[1\]: empty"):
            await sched.embed([[1, 2], []], Lane.ONLINE)
        assert (await sched.embed([], Lane.ONLINE)).shape == (0, DIMS)
        await sched.drain()

    run(main())


def test_real_engine_vectors_match_unscheduled_ones():
    """The bundled MiniLM on CPU through the scheduler: split, packed with other work, reordered."""
    import torch

    from core_engine.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared 2-core runner thrash (~20x slower)
    try:
        _check_real_engine(Engine(device="cpu"))
    finally:
        torch.set_num_threads(threads)


def _check_real_engine(engine) -> None:
    rng = np.random.default_rng(11)
    requests = [
        [[101, *rng.integers(1000, 20000, int(rng.integers(1, 40))).tolist(), 102] for _ in range(n)]
        for n in (1, 5, 24, 3)
    ]
    alone = [np.concatenate([engine.embed([s]) for s in seqs]) for seqs in requests]

    async def main():
        sched = Scheduler([engine], SchedulerConfig.for_device("cpu", max_step_tokens=256, online_step_tokens=64))
        await sched.start()
        lanes = [Lane.BATCH, Lane.ONLINE, Lane.BATCH, Lane.ONLINE]
        got = await asyncio.gather(*(sched.embed(r, lane) for r, lane in zip(requests, lanes)))
        await sched.drain()
        return got, sched.stats()

    got, stats = run(main(), timeout=120)
    for mine, ref in zip(got, alone):
        assert mine.shape == ref.shape == (len(ref), engine.spec.dimensions)
        np.testing.assert_allclose(mine, ref, rtol=0, atol=2e-5)
    assert stats.steps >= 2  # the 24-sequence request (~500 tokens) did not fit one 256-token step


class JitteryEngine(GatedEngine):
    """Ungated stand-in whose results take a random 0-2 ms, like a busy device."""

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(gated=False, name=name)
        self._rng = np.random.default_rng(seed)

    def step(self, prepared: list[tuple[int, ...]]) -> Handle:
        handle = super().step(prepared)
        delay = float(self._rng.uniform(0, 0.002))
        inner = handle.result

        def result() -> np.ndarray:
            time.sleep(delay)
            return inner()

        handle.result = result  # type: ignore[method-assign]
        return handle


async def _random_load(sched: Scheduler, rng: np.random.Generator, count: int, *, online_share: float,
                       max_seqs: int, deadline_share: float, deadline_s: float, cancel_s: float,
                       pause: Callable[[int], bool]) -> list[tuple[list[list[int]], asyncio.Task]]:
    """`count` requests of random lane and size (BATCH ones wait for room), some with a deadline
    within `deadline_s`, 15 % cancelled within `cancel_s`, with a short pause after request i
    where `pause(i)`: (sequences, task) of each."""
    jobs = []
    for i in range(count):
        lane = Lane.ONLINE if rng.random() < online_share else Lane.BATCH
        mark = ONLINE_MARK if lane == Lane.ONLINE else BATCH_MARK
        seqs = [[mark, i, k] + [3] * int(rng.integers(0, 20)) for k in range(int(rng.integers(1, max_seqs)))]
        deadline = time.monotonic() + float(rng.uniform(0.001, deadline_s)) if rng.random() < deadline_share else None
        task = asyncio.create_task(sched.embed(seqs, lane, deadline, wait=lane == Lane.BATCH))
        jobs.append((seqs, task))
        if rng.random() < 0.15:
            asyncio.get_running_loop().call_later(float(rng.uniform(0, cancel_s)), task.cancel)
        if pause(i):
            await asyncio.sleep(float(rng.uniform(0, 0.003)))
    return jobs


def test_random_load_with_cancels_and_deadlines_leaves_nothing_behind():
    rng = np.random.default_rng(5)

    async def main():
        engines = [JitteryEngine("cuda:fake0", 1), JitteryEngine("fake:1", 2)]
        sched = Scheduler(engines, config(max_step_tokens=96, online_step_tokens=48,
                                          max_queued_tokens_batch=3000, max_queued_tokens_online=1500))
        await sched.start()
        jobs = await _random_load(sched, rng, 400, online_share=0.4, max_seqs=10, deadline_share=0.2,
                                  deadline_s=0.05, cancel_s=0.01, pause=lambda i: i % 8 == 0)
        outcomes = {"done": 0, "cancelled": 0, "expired": 0, "full": 0}
        for seqs, task in jobs:
            try:
                got = await task
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            except DeadlineExceeded:
                outcomes["expired"] += 1
            except QueueFull:
                outcomes["full"] += 1
            else:
                outcomes["done"] += 1
                np.testing.assert_array_equal(got, expected(seqs))
        await sched.drain()
        stats = sched.stats()
        assert stats.online.queued_tokens == stats.batch.queued_tokens == 0
        assert stats.online.queued_requests == stats.batch.queued_requests == 0
        assert all(e.inflight_tokens == 0 for e in stats.engines)
        assert stats.tokens == sum(len(s) for e in engines for step in e.stepped for s in step)
        assert all(e.stepped for e in engines)  # both engines took work
        assert outcomes["done"] > 200 and outcomes["cancelled"] + outcomes["expired"] > 20, outcomes

    run(main(), timeout=60)


# ----------------------------------------------------------------------------- launch on arrival

def _threads_of(engine: GatedEngine, call: str) -> list[str]:
    return [name for c, name in engine.threads if c == call]


async def _engines_waiting(sched: Scheduler) -> None:
    """Wait until every engine thread waits for work: only then can the loop claim its engine.
    (A thread hands out a step's results just before it gets there.)"""
    await until(lambda: all(w.waiting for w in sched._workers))  # noqa: SLF001


async def _started(sched: Scheduler) -> None:
    await sched.start()
    await _engines_waiting(sched)


@pytest.mark.parametrize("device, on, launched_by", [
    ("cuda:fake", True, "MainThread"),          # idle async engine: the event loop launches
    ("cuda:fake", False, "fern-engine-0"),      # switched off: the engine's thread does
    ("cpu:fake", True, "fern-engine-0"),        # a synchronous engine never runs on the loop
])
def test_an_online_request_on_an_idle_engine_is_launched_where_expected(device, on, launched_by):
    async def main():
        engine = GatedEngine(gated=False, name=device)
        sched = Scheduler([engine], SchedulerConfig(**{**config().__dict__, "launch_on_arrival": on}))
        await _started(sched)
        query = texts(ONLINE_MARK, 0, 2)
        np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "prepare") == [launched_by]
        assert _threads_of(engine, "step") == [launched_by]
        batch = texts(BATCH_MARK, 0, 2)
        np.testing.assert_array_equal(await sched.embed(batch, Lane.BATCH), expected(batch))
        assert _threads_of(engine, "prepare")[-1] == "fern-engine-0"  # BATCH work: never on the loop
        stats = sched.stats()
        assert (stats.steps, stats.online.completed, stats.batch.completed) == (2, 1, 1)
        assert stats.engines[0].inflight_tokens == 0
        await sched.drain()

    run(main())


def test_the_loop_waits_for_its_own_launch_and_work_arriving_meanwhile_goes_to_the_engine_thread():
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config(max_step_tokens=64, online_step_tokens=32))
        await _started(sched)
        head = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE))
        await until(lambda: engine.done_calls > 3)  # the loop polls its step, no thread waits in result()
        assert engine.waiting == 0 and _threads_of(engine, "step") == ["MainThread"]
        # The engine is busy with the loop's step: queries arriving now are not launched from
        # the loop one by one but built by the engine's thread into one step behind it.
        queries = [texts(ONLINE_MARK, 10 + i, 1) for i in range(3)]
        tasks = [asyncio.create_task(sched.embed(q, Lane.ONLINE)) for q in queries]
        await until(lambda: len(engine.stepped) == 2)
        assert engine.stepped[1] == [tuple(q[0]) for q in queries]
        assert _threads_of(engine, "step") == ["MainThread", "fern-engine-0"]
        assert not head.done()
        engine.release(10**6)
        np.testing.assert_array_equal(await head, expected(texts(ONLINE_MARK, 0, 1)))
        for q, task in zip(queries, tasks):
            np.testing.assert_array_equal(await task, expected(q))
        # Idle again: the next query is the loop's again.
        await _engines_waiting(sched)
        query = texts(ONLINE_MARK, 50, 1)
        np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "step")[-1] == "MainThread"
        await sched.drain()

    run(main())


def test_cancelling_the_query_that_launched_a_step_does_not_stop_the_wait_for_that_step():
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config())
        await _started(sched)
        first = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE))
        await until(lambda: len(engine.stepped) == 1 and engine.done_calls > 0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.01)
        assert sched._collecting  # the step is still waited for: the engine is not idle yet
        later = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 1, 1), Lane.ONLINE))
        await until(lambda: len(engine.stepped) == 2)
        assert _threads_of(engine, "step") == ["MainThread", "fern-engine-0"]
        engine.release(10**6)
        np.testing.assert_array_equal(await later, expected(texts(ONLINE_MARK, 1, 1)))
        await until(lambda: not sched._collecting)
        await _engines_waiting(sched)
        query = texts(ONLINE_MARK, 2, 1)  # idle again, the loop's step done: the loop launches
        np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "step")[-1] == "MainThread"
        stats = sched.stats()
        assert (stats.online.cancelled, stats.online.completed, stats.engines[0].inflight_tokens) == (1, 2, 0)
        await sched.drain()

    run(main())


def test_the_loop_hands_a_step_still_running_after_its_poll_budget_to_a_thread():
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config(online_poll_s=0.02))
        await _started(sched)
        query = texts(ONLINE_MARK, 0, 1)
        task = asyncio.create_task(sched.embed(query, Lane.ONLINE))
        await until(lambda: engine.waiting == 1)  # past 20 ms of polling: a thread waits in result()
        polls = engine.done_calls
        await asyncio.sleep(0.05)
        assert engine.done_calls == polls  # and the loop stopped polling
        engine.release()
        np.testing.assert_array_equal(await task, expected(query))
        await sched.drain()

    run(main())


def test_a_failed_launch_on_arrival_fails_only_its_request_and_serving_goes_on():
    async def main():
        engine = GatedEngine(gated=False, name="cuda:fake", fail_prepare=True)
        sched = Scheduler([engine], config())
        await _started(sched)
        with pytest.raises(RuntimeError, match="prepare failed"):
            await sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE)
        assert _threads_of(engine, "prepare") == ["MainThread"]
        engine.fail_prepare = False
        for n in range(3):  # the engine is claimable again, and its thread serves batch work
            query = texts(ONLINE_MARK, 10 + n, 1)
            np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
            batch = texts(BATCH_MARK, 10 + n, 2)
            np.testing.assert_array_equal(await sched.embed(batch, Lane.BATCH), expected(batch))
        assert sched.stats().engines[0].inflight_tokens == 0
        await sched.drain()

    run(main())


@pytest.mark.parametrize("engines", [1, 2])
def test_launch_on_arrival_under_concurrent_load_never_shares_an_engine(engines):
    async def main():
        fleet = [GatedEngine(gated=False, name=f"cuda:{i}") for i in range(engines)]
        sched = Scheduler(fleet, config(max_step_tokens=64, online_step_tokens=32))
        await _started(sched)
        requests = []
        for i in range(300):
            lane = Lane.ONLINE if i % 3 else Lane.BATCH
            requests.append((lane, texts(ONLINE_MARK if lane is Lane.ONLINE else BATCH_MARK, 1000 * i, 1 + i % 4)))
        results = await asyncio.gather(*(sched.embed(seqs, lane) for lane, seqs in requests))
        for (_, seqs), rows in zip(requests, results):
            np.testing.assert_array_equal(rows, expected(seqs))
        stepped = [s for engine in fleet for step in engine.stepped for s in step]
        assert sorted(stepped) == sorted(tuple(s) for _, seqs in requests for s in seqs)  # each once
        assert not any(engine.overlapped for engine in fleet)
        assert any(name == "MainThread" for engine in fleet for _, name in engine.threads)
        await sched.drain()

    run(main())


def test_a_step_that_would_not_replay_a_graph_is_launched_by_the_engine_thread():
    async def main():
        engine = GatedEngine(gated=False, name="cuda:fake")
        engine.cheap_launches = 0  # every step is an eager step or a capture, until told otherwise
        sched = Scheduler([engine], config())
        await _started(sched)
        for n in range(2):
            await _engines_waiting(sched)
            query = texts(ONLINE_MARK, n, 1)
            np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "prepare") == ["MainThread"] * 2
        assert _threads_of(engine, "step") == ["fern-engine-0"] * 2
        engine.cheap_launches = 1  # a replay now
        await _engines_waiting(sched)
        query = texts(ONLINE_MARK, 5, 1)
        np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "step")[-1] == "MainThread"
        assert sched.stats().steps == 3 and sched.stats().engines[0].inflight_tokens == 0
        await sched.drain()

    run(main())


def test_an_engine_error_while_deciding_where_to_launch_fails_that_step_and_frees_the_engine():
    async def main():
        engine = GatedEngine(gated=False, name="cuda:fake")
        engine.fail_replays = True
        sched = Scheduler([engine], config())
        await _started(sched)
        with pytest.raises(RuntimeError, match="replays failed"):
            await sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE)
        engine.fail_replays = False
        query = texts(ONLINE_MARK, 1, 1)
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(query, Lane.ONLINE), 5), expected(query))
        batch = texts(BATCH_MARK, 1, 2)
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(batch, Lane.BATCH), 5), expected(batch))
        assert sched.stats().engines[0].inflight_tokens == 0
        await sched.drain()

    run(main())


def test_a_failed_launch_of_a_step_the_loop_prepared_leaves_the_engine_thread_serving():
    async def main():
        engine = GatedEngine(gated=False, name="cuda:fake")
        engine.cheap_launches = 0  # not a replay: the loop prepares, the engine's thread launches
        engine.fail_step = True
        sched = Scheduler([engine], config())
        await _started(sched)
        with pytest.raises(RuntimeError, match="step failed"):
            await asyncio.wait_for(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE), 5)
        assert _threads_of(engine, "prepare") == ["MainThread"]
        assert engine.raised_in == [("step", "fern-engine-0")]
        engine.fail_step = False
        batch = texts(BATCH_MARK, 1, 2)
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(batch, Lane.BATCH), 5), expected(batch))
        query = texts(ONLINE_MARK, 1, 1)
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(query, Lane.ONLINE), 5), expected(query))
        assert sched.stats().engines[0].inflight_tokens == 0
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


def _assert_idle(sched: Scheduler) -> None:
    """Nothing queued, composed, claimed or in flight anywhere, and no request left unsettled."""
    stats = sched.stats()
    assert stats.online.queued_tokens == stats.batch.queued_tokens == 0
    assert stats.online.queued_requests == stats.batch.queued_requests == 0
    assert all(e.inflight_tokens == 0 for e in stats.engines), stats.engines
    assert not sched._live and not sched._collecting  # noqa: SLF001
    for w in sched._workers:  # noqa: SLF001
        assert (w.claimed, w.adopted, w.loop_steps, w.holding) == (False, None, 0, False)


@pytest.mark.parametrize("call, gated, raised_by", [
    ("step", False, "MainThread"),        # the loop's launch
    ("done", False, "MainThread"),        # the loop's poll
    ("result", False, "MainThread"),      # done at the first poll: collected on the loop
    ("result", True, "asyncio"),          # still running after the poll budget: on a thread
])
def test_an_engine_error_in_a_step_the_loop_launched_or_waits_for_fails_it_and_frees_the_engine(call, gated, raised_by):
    async def main():
        engine = GatedEngine(gated=gated, name="cuda:fake")
        setattr(engine, f"fail_{call}", True)
        sched = Scheduler([engine], config(online_poll_s=0.005))
        await _started(sched)
        with pytest.raises(RuntimeError, match=f"{call} failed"):
            await asyncio.wait_for(sched.embed(texts(ONLINE_MARK, 0, 2), Lane.ONLINE), 5)
        assert [c for c, _ in engine.raised_in] == [call]
        assert engine.raised_in[0][1].startswith(raised_by)
        assert _threads_of(engine, "prepare") == ["MainThread"]
        await until(lambda: not sched._collecting)  # noqa: SLF001
        _assert_idle(sched)
        setattr(engine, f"fail_{call}", False)
        engine.release(10**6)
        await _engines_waiting(sched)
        query = texts(ONLINE_MARK, 1, 1)  # the engine is claimable again: the loop launches
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(query, Lane.ONLINE), 5), expected(query))
        assert _threads_of(engine, "step")[-1] == "MainThread"
        batch = texts(BATCH_MARK, 1, 2)  # and its thread still serves
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(batch, Lane.BATCH), 5), expected(batch))
        stats = sched.stats()
        assert (stats.online.completed, stats.batch.completed) == (1, 1)
        _assert_idle(sched)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


@pytest.mark.parametrize("poll_s", [0.0, 0.02])
def test_drain_waits_for_a_step_the_loop_launched_for_a_cancelled_query(poll_s):
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config(online_poll_s=poll_s))
        await _started(sched)
        query = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 0, 1), Lane.ONLINE))
        await until(lambda: len(engine.stepped) == 1)
        assert _threads_of(engine, "step") == ["MainThread"]
        query.cancel()
        with pytest.raises(asyncio.CancelledError):
            await query
        drain = asyncio.create_task(sched.drain())
        await asyncio.sleep(0.05)
        assert not drain.done()  # its step is still on the engine
        assert all(w.thread.is_alive() for w in sched._workers)  # noqa: SLF001
        engine.release()
        await asyncio.wait_for(drain, 5)
        assert not any(w.thread.is_alive() for w in sched._workers)  # noqa: SLF001
        assert engine.permits == 0  # the step was collected before drain returned
        stats = sched.stats()
        assert (stats.online.cancelled, stats.online.completed, stats.steps) == (1, 0, 1)
        _assert_idle(sched)

    run(main())


def test_a_query_whose_deadline_passes_during_the_loops_step_hears_at_the_deadline():
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config(online_poll_s=10.0))  # the loop keeps polling throughout
        await _started(sched)
        late = texts(ONLINE_MARK, 0, 2)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await sched.embed(late, Lane.ONLINE, deadline=time.monotonic() + 0.05)
        assert time.monotonic() - started < 1.0
        assert engine.stepped == [[tuple(s) for s in late]] and _threads_of(engine, "step") == ["MainThread"]
        assert sched._collecting and sched.stats().engines[0].inflight_tokens == 16  # noqa: SLF001
        # The engine is still busy with that step: the next query goes to its thread.
        nxt = asyncio.create_task(sched.embed(texts(ONLINE_MARK, 5, 1), Lane.ONLINE))
        await until(lambda: len(engine.stepped) == 2)
        assert _threads_of(engine, "step") == ["MainThread", "fern-engine-0"]
        engine.release(2)
        np.testing.assert_array_equal(await asyncio.wait_for(nxt, 5), expected(texts(ONLINE_MARK, 5, 1)))
        await until(lambda: not sched._collecting)  # noqa: SLF001
        stats = sched.stats()
        assert (stats.online.expired, stats.online.completed) == (1, 1)
        _assert_idle(sched)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


def test_each_idle_engine_takes_a_query_from_the_loop_and_a_third_goes_to_an_engine_thread():
    async def main():
        fleet = [GatedEngine(name=f"cuda:{i}") for i in range(2)]
        sched = Scheduler(fleet, config())
        await _started(sched)
        queries = [texts(ONLINE_MARK, 10 * i, 1) for i in range(3)]
        first = [asyncio.create_task(sched.embed(q, Lane.ONLINE)) for q in queries[:2]]
        await until(lambda: all(e.stepped for e in fleet))
        assert [_threads_of(e, "step") for e in fleet] == [["MainThread"], ["MainThread"]]
        assert sum(w.loop_steps for w in sched._workers) == 2  # noqa: SLF001
        third = asyncio.create_task(sched.embed(queries[2], Lane.ONLINE))
        await until(lambda: sum(len(e.stepped) for e in fleet) == 3)
        launched_by = [n for e in fleet for n in _threads_of(e, "step")]
        assert launched_by.count("MainThread") == 2
        assert [n for n in launched_by if n != "MainThread"][0].startswith("fern-engine-")
        for e in fleet:
            e.release(10**6)
        for q, got in zip(queries, await asyncio.gather(*first, third)):
            np.testing.assert_array_equal(got, expected(q))
        assert not any(e.overlapped for e in fleet)
        await until(lambda: not sched._collecting)  # noqa: SLF001
        _assert_idle(sched)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


def test_work_arriving_during_a_loop_step_goes_to_an_idle_engine_not_behind_that_step():
    async def main():
        fleet = [GatedEngine(name=f"cuda:{i}") for i in range(2)]
        sched = Scheduler(fleet, config())
        await _started(sched)
        # A batch step keeps one engine's thread busy, so the query below is claimed for the other.
        first = asyncio.create_task(sched.embed(texts(BATCH_MARK, 0, 2), Lane.BATCH))
        await until(lambda: sum(len(e.stepped) for e in fleet) == 1)
        free = next(e for e in fleet if e.stepped)
        looped = next(e for e in fleet if not e.stepped)
        online = texts(ONLINE_MARK, 0, 1)
        query = asyncio.create_task(sched.embed(online, Lane.ONLINE))
        await until(lambda: len(looped.stepped) == 1)
        assert _threads_of(looped, "step") == ["MainThread"]
        # The batch step ends: that engine is idle again. Its thread now waits for work behind
        # the other engine's thread (waiting since the start), which the next wake-up reaches first.
        free.release()
        await asyncio.wait_for(first, 5)
        await _engines_waiting(sched)
        batch = texts(BATCH_MARK, 10, 2)
        task = asyncio.create_task(sched.embed(batch, Lane.BATCH))
        await until(lambda: sum(len(e.stepped) for e in fleet) == 3)
        assert len(looped.prepared) == 1  # nothing was built behind the loop's step
        assert free.stepped[-1] == [tuple(s) for s in batch]
        assert _threads_of(free, "step")[-1] == f"fern-engine-{fleet.index(free)}"
        free.release()
        np.testing.assert_array_equal(await asyncio.wait_for(task, 5), expected(batch))
        looped.release()
        np.testing.assert_array_equal(await asyncio.wait_for(query, 5), expected(online))
        await until(lambda: not sched._collecting)  # noqa: SLF001
        _assert_idle(sched)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


def test_a_query_larger_than_a_step_starts_on_the_loop_and_ends_on_the_engine_thread():
    async def main():
        engine = GatedEngine(name="cuda:fake")
        sched = Scheduler([engine], config(max_step_tokens=64, online_step_tokens=32))
        await _started(sched)
        # 48 tokens: more than a step carrying online work plus batch fill may have, but within
        # an online-only step (as the engine's thread composes one): a single step, from the loop.
        small = texts(ONLINE_MARK, 100, 6)
        rows, _ = await asyncio.wait_for(asyncio.gather(sched.embed(small, Lane.ONLINE), _release_soon(engine)), 5)
        np.testing.assert_array_equal(rows, expected(small))
        assert engine.stepped == [[tuple(s) for s in small]]
        await until(lambda: not sched._collecting)  # noqa: SLF001
        await until(lambda: engine.waiting == 0 and sched._workers[0].waiting)  # noqa: SLF001
        query = texts(ONLINE_MARK, 0, 12)  # 96 tokens: a full step from the loop, the rest on the thread
        task = asyncio.create_task(sched.embed(query, Lane.ONLINE))
        await until(lambda: len(engine.stepped) == 3)
        assert engine.stepped[1:] == [[tuple(s) for s in query[:8]], [tuple(s) for s in query[8:]]]
        assert _threads_of(engine, "step") == ["MainThread", "MainThread", "fern-engine-0"]
        assert sched.stats().engines[0].inflight_tokens == 96
        engine.release(2)
        np.testing.assert_array_equal(await asyncio.wait_for(task, 5), expected(query))
        await until(lambda: not sched._collecting)  # noqa: SLF001
        assert sched.stats().online.completed == 2
        _assert_idle(sched)
        await asyncio.wait_for(sched.drain(), 5)

    run(main())


async def _release_soon(engine: GatedEngine) -> None:
    await until(lambda: len(engine.stepped) >= 1)
    engine.release()


class ChaoticEngine(GatedEngine):
    """Ungated stand-in whose steps take a random 0-2 ms, some launches are eager (not replays),
    and any call (prepare, replays, step, done, result) fails now and then."""

    def __init__(self, name: str, seed: int, failure_rate: float) -> None:
        super().__init__(gated=False, name=name)
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._failure_rate = failure_rate
        self.failures = 0

    def _draw(self) -> float:
        with self._rng_lock:
            return float(self._rng.random())

    def _maybe_fail(self, call: str) -> None:
        if self._draw() < self._failure_rate:
            with self._rng_lock:
                self.failures += 1
            self.raise_here(call)

    def prepare(self, sequences: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        self._maybe_fail("prepare")
        return super().prepare(sequences)

    def replays(self, prepared: list[tuple[int, ...]]) -> bool:
        self._maybe_fail("replays")
        return self._draw() < 0.7

    def step(self, prepared: list[tuple[int, ...]]) -> Handle:
        self._maybe_fail("step")
        handle = super().step(prepared)
        ready_at = time.monotonic() + 0.002 * self._draw()
        inner_done, inner_result = handle.done, handle.result

        def done() -> bool:
            self._maybe_fail("done")
            return inner_done() and time.monotonic() >= ready_at

        def result() -> np.ndarray:
            self._maybe_fail("result")
            time.sleep(max(0.0, ready_at - time.monotonic()))
            return inner_result()

        handle.done, handle.result = done, result  # type: ignore[method-assign]
        return handle


@pytest.mark.parametrize("engines, poll_s, seed", [
    (1, 0.02, 1), (1, 0.0005, 2), (1, 0.0, 3), (2, 0.02, 4), (2, 0.0005, 5), (3, 0.0, 6),
])
def test_launch_on_arrival_with_failing_engines_cancels_and_deadlines_settles_everything(engines, poll_s, seed):
    rng = np.random.default_rng(seed)

    async def main():
        loop_errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
        fleet = [ChaoticEngine(f"cuda:{i}", seed * 10 + i, failure_rate=0.02) for i in range(engines)]
        sched = Scheduler(fleet, config(max_step_tokens=96, online_step_tokens=32,
                                        max_queued_tokens_batch=3000, max_queued_tokens_online=1500,
                                        online_poll_s=poll_s))
        await _started(sched)
        # Frequent pauses: gaps in which an engine goes idle, so the loop launches.
        jobs = await _random_load(sched, rng, 300, online_share=0.6, max_seqs=8, deadline_share=0.15,
                                  deadline_s=0.03, cancel_s=0.005, pause=lambda _: rng.random() < 0.5)
        done, pending = await asyncio.wait([task for _, task in jobs], timeout=15)
        assert not pending, f"{len(pending)} requests never settled"
        outcomes = {"done": 0, "cancelled": 0, "expired": 0, "failed": 0, "full": 0}
        for seqs, task in jobs:
            if task.cancelled():
                outcomes["cancelled"] += 1
            elif isinstance(task.exception(), DeadlineExceeded):
                outcomes["expired"] += 1
            elif isinstance(task.exception(), QueueFull):
                outcomes["full"] += 1
            elif task.exception() is not None:
                assert str(task.exception()).startswith("engine stand-in:"), task.exception()
                outcomes["failed"] += 1
            else:
                outcomes["done"] += 1
                np.testing.assert_array_equal(task.result(), expected(seqs))
        assert all(w.thread.is_alive() for w in sched._workers)  # noqa: SLF001  (no engine thread gave up)
        # Steps whose requests were all cancelled may still run: drain waits for them.
        await asyncio.wait_for(sched.drain(), 10)
        _assert_idle(sched)
        assert not loop_errors, loop_errors
        assert not any(e.overlapped for e in fleet)
        stepped = [s for e in fleet for step in e.stepped for s in step]
        assert len(stepped) == len(set(stepped))  # no sequence ran twice
        assert sched.stats().tokens == sum(map(len, stepped))
        launched_by = [n for e in fleet for n in _threads_of(e, "step")]
        assert "MainThread" in launched_by and any(n.startswith("fern-engine-") for n in launched_by)
        assert sum(e.failures for e in fleet) > 0 and outcomes["done"] > 100, outcomes

    run(main(), timeout=60)


def test_a_query_the_loop_launches_and_collects_never_wakes_the_engine_thread():
    async def main():
        engine = GatedEngine(gated=False, name="cuda:fake")
        sched = Scheduler([engine], config())
        wakes = []

        class Counting(threading.Condition):
            def wait(self, timeout=None):
                try:
                    return super().wait(timeout)
                finally:
                    wakes.append(threading.current_thread().name)

        sched._cond = Counting(sched._cond._lock)  # noqa: SLF001 - same lock as _loads
        await _started(sched)
        for n in range(5):
            query = texts(ONLINE_MARK, n, 1)
            np.testing.assert_array_equal(await sched.embed(query, Lane.ONLINE), expected(query))
        assert _threads_of(engine, "step") == ["MainThread"] * 5
        assert sched.stats().engines[0].loop_launches == 5
        assert wakes == []  # each wake-up would take the GIL from the loop mid-query
        batch = texts(BATCH_MARK, 0, 2)  # work for the thread still wakes it
        np.testing.assert_array_equal(await asyncio.wait_for(sched.embed(batch, Lane.BATCH), 5), expected(batch))
        assert "fern-engine-0" in wakes
        stats = sched.stats().engines[0]
        assert (stats.steps, stats.loop_launches) == (6, 5)
        await sched.drain()

    run(main())
