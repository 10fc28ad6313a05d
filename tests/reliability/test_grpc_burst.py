"""Bursts of concurrent calls on one channel against a real `fern serve`: every call answered with a status it
can act on (never a CANCELLED it did not ask for), and a log free of tracebacks for ordinary outcomes."""

from __future__ import annotations

import asyncio
import collections
import random

import grpc
import pytest

from sidecar.client import AsyncFernClient, FernClient, FernError

BURST = 2000
# Generous: the burst takes ~10-25 s on the 2-core CI host; a server that lost calls would hang to here.
BURST_TIMEOUT_S = 240
CLIENTS = 250


@pytest.fixture(scope="module")
def sidecar(sidecar_factory):
    process = sidecar_factory()
    yield process
    process.stop()


async def _burst(target: str, count: int, **client_options) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    async with AsyncFernClient(target) as client:
        for name, value in client_options.items():
            setattr(client, name, value)
        await client.embed(["warm up"])

        async def one(i: int) -> None:
            try:
                await client.embed([f"tiny call {i}"], timeout=BURST_TIMEOUT_S)
                outcomes["OK"] += 1
            except FernError as error:
                outcomes[error.code.name] += 1
                outcomes[f"{error.code.name}: {error.message}"] += 1

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), BURST_TIMEOUT_S)
    return outcomes


@pytest.mark.slow
def test_a_burst_on_one_channel_is_answered_without_unasked_cancels(sidecar):
    # No client-side bound: all 2,000 calls reach the server at once.
    outcomes = asyncio.run(_burst(sidecar.target, BURST, max_in_flight=None))
    assert outcomes["CANCELLED"] == 0, outcomes
    assert set(k for k in outcomes if ":" not in k) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["OK"] + outcomes["RESOURCE_EXHAUSTED"] == BURST
    for key in outcomes:
        if key.startswith("RESOURCE_EXHAUSTED:"):
            assert "queue is full" in key and "retry" in key, key


@pytest.mark.slow
def test_the_async_client_bounds_its_own_calls_in_flight(sidecar):
    peak = now = 0

    async def go() -> int:
        async with AsyncFernClient(sidecar.target) as client:
            client.max_in_flight = 64
            real = client._stub.Embed

            async def counted(*args, **kwargs):  # the real stub, with a count of calls in flight
                nonlocal peak, now
                now += 1
                peak = max(peak, now)
                try:
                    return await real(*args, **kwargs)
                finally:
                    now -= 1

            client._stub.Embed = counted
            done = await asyncio.wait_for(asyncio.gather(
                *(client.embed([f"tiny call {i}"], timeout=BURST_TIMEOUT_S) for i in range(BURST))),
                BURST_TIMEOUT_S)
            return len(done)

    assert asyncio.run(go()) == BURST
    assert 1 < peak <= 64


def test_a_call_waiting_for_a_client_slot_keeps_its_deadline(sidecar):
    with FernClient(sidecar.target) as client:
        client.max_in_flight = 1
        slots = client._in_flight_slots()
        assert slots.acquire()  # the one slot is busy
        try:
            with pytest.raises(FernError) as info:
                client.embed(["waits"], timeout=0.2)
        finally:
            slots.release()
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "max_in_flight" in info.value.message
        assert client.embed(["now it fits"]).vectors.shape == (1, 384)


@pytest.mark.slow
def test_the_sync_client_from_many_threads_gets_no_unasked_cancels(sidecar):
    from concurrent.futures import ThreadPoolExecutor

    with FernClient(sidecar.target, timeout=BURST_TIMEOUT_S) as client, ThreadPoolExecutor(200) as pool:
        def one(i: int) -> str:
            try:
                client.embed([f"tiny call {i}"])
                return "OK"
            except FernError as error:
                return error.code.name

        outcomes = collections.Counter(pool.map(one, range(BURST)))
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes


@pytest.mark.slow
def test_tiny_deadlines_and_cancellations_leave_no_traceback_in_the_log(sidecar):
    rng = random.Random(9)

    async def go() -> collections.Counter:
        codes: collections.Counter = collections.Counter()
        # Many clients (channels), as a fleet of callers would be: each call on one of them.
        clients = [AsyncFernClient(sidecar.target) for _ in range(CLIENTS)]
        try:
            client = clients[0]
            await client.embed(["warm up"])

            async def deadline(i: int) -> None:
                client = clients[i % CLIENTS]
                try:
                    await client.embed([f"a text {i} " * rng.randint(1, 60)], timeout=rng.uniform(0.01, 3.0))
                    codes["OK"] += 1
                except FernError as error:
                    codes[error.code.name] += 1

            async def cancelled(i: int) -> None:
                client = clients[i % CLIENTS]
                task = asyncio.ensure_future(client.embed([f"cancel me {i} " * rng.randint(1, 60)]))
                await asyncio.sleep(rng.uniform(0, 3.0))
                task.cancel()
                try:
                    await task
                    codes["OK"] += 1
                except asyncio.CancelledError:
                    codes["cancelled"] += 1
                except FernError as error:
                    codes[error.code.name] += 1

            calls = [deadline(i) for i in range(700)] + [cancelled(i) for i in range(300)]
            rng.shuffle(calls)
            await asyncio.wait_for(asyncio.gather(*calls), BURST_TIMEOUT_S)
            assert (await client.embed(["still serving"])).vectors.shape == (1, 384)
        finally:
            for client in clients:
                await client.close()
        return codes

    codes = asyncio.run(go())
    assert codes["DEADLINE_EXCEEDED"] > 0 and codes["cancelled"] > 0, codes
    log = sidecar.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 2000:][:6000]
    assert "ExecuteBatchError" not in log and "Unexpected" not in log, log[-6000:]
