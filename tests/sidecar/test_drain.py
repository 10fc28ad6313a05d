"""Draining an in-process Sidecar: an open EmbedStream gets its answers, then UNAVAILABLE; health flips."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from sidecar.client import AsyncFernClient, FernError
from sidecar.registry import ModelSource, Registry
from sidecar.server import Sidecar


@pytest.fixture
def registry():
    """A fresh registry per test: stopping a Sidecar drains its schedulers for good."""
    return Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1)


def test_open_stream_is_answered_then_told_to_go_elsewhere(registry):
    async def main():
        sidecar = Sidecar(registry, port=0)
        await sidecar.start()
        sent_two = asyncio.Event()
        never = asyncio.Event()

        async def requests():
            yield ("one", ["first request"])
            yield ("two", ["second request"])
            sent_two.set()
            await never.wait()  # an idle client that keeps its stream open
            yield ("three", ["never read"])

        results, failure = [], None
        async with AsyncFernClient(sidecar.target, timeout=60) as client:
            async def consume():
                nonlocal failure
                try:
                    async for r in client.embed_stream(requests()):
                        results.append(r)
                except FernError as error:
                    failure = error

            consumer = asyncio.create_task(consume())
            await sent_two.wait()
            while len(results) < 2:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(sidecar.stop(grace=30))
            await asyncio.wait_for(consumer, 30)
            await asyncio.wait_for(stopping, 30)
            never.set()
        # The server is closed now; ask its health servicer directly.
        health = await sidecar.health.Check(health_pb2.HealthCheckRequest(), None)
        return results, failure, health.status

    results, failure, health = asyncio.run(main())
    assert sorted(r.request_id for r in results) == ["one", "two"]
    assert all(r.error is None for r in results)
    assert failure is not None and failure.code == grpc.StatusCode.UNAVAILABLE
    assert "draining" in failure.message
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING


def test_calls_past_the_grace_period_are_cancelled_and_stop_returns(registry):
    async def main():
        sidecar = Sidecar(registry, port=0)
        await sidecar.start()
        async with AsyncFernClient(sidecar.target, timeout=120) as client:
            slow = asyncio.create_task(client.embed(["word " * 300] * 64, lane="batch"))
            await asyncio.sleep(0.5)
            started = asyncio.get_running_loop().time()
            await asyncio.wait_for(sidecar.stop(grace=0.5), 30)
            took = asyncio.get_running_loop().time() - started
            with pytest.raises(FernError) as info:
                await slow
        return took, info.value.code

    took, code = asyncio.run(main())
    assert took < 10
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def test_wait_idle_with_no_grace_is_true_when_nothing_is_in_flight():
    from sidecar.server import EmbedderService

    async def main():
        service = EmbedderService(gateway=None)
        assert await service.wait_idle(0) is True  # was False: wait_for(..., 0) times out first
        with service._tracked():
            assert await service.wait_idle(0) is False
        assert await service.wait_idle(0.01) is True

    asyncio.run(main())


def test_a_call_not_yet_in_its_handler_is_answered_not_cancelled(registry):
    """The drain waits for every call gRPC has accepted, not only those already in the Embed handler.

    A wrong-token call held for its back-off sits in the auth interceptor, where the service's
    own count of calls in flight cannot see it (as does a call whose body is still arriving).
    Draining must answer it, UNAUTHENTICATED after its back-off, rather than cancel it.
    """
    from sidecar.security import AuthLimiter, LimiterConfig

    async def main():
        limiter = AuthLimiter(LimiterConfig(free_failures=0, base_delay_s=1.0, max_delay_s=1.0))
        sidecar = Sidecar(registry, port=0, token="drain-suite-token", limiter=limiter)
        await sidecar.start()
        async with AsyncFernClient(sidecar.target, token="wrong", timeout=60) as client:
            held = asyncio.create_task(client.embed(["held for its back-off"]))
            while limiter.held_calls == 0:
                await asyncio.sleep(0.01)
            await asyncio.wait_for(sidecar.stop(grace=30), 30)
            with pytest.raises(FernError) as info:
                await held
        return info.value.code

    assert asyncio.run(main()) == grpc.StatusCode.UNAUTHENTICATED
