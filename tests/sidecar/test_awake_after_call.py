"""After a unary Embed the sidecar's event loop polls for a bounded while, then sleeps again; stop() ends it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from sidecar.client import AsyncFernClient
from sidecar.registry import ModelSource, Registry
from sidecar.server import Sidecar


@pytest.fixture
def registry():
    """A fresh registry per test: stopping a Sidecar drains its schedulers for good."""
    return Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1)


def test_the_loop_sleeps_again_once_the_window_after_a_call_has_passed(registry):
    window = 0.2

    async def main():
        sidecar = Sidecar(registry, port=0, awake_after_call_s=window)
        await sidecar.start()
        try:
            async with AsyncFernClient(sidecar.target, timeout=60) as client:
                first = await client.embed(["a query", "another one"])
                again = await client.embed(["a query", "another one"])  # inside the window
                polling_after_call = sidecar.service._awake is not None
                await asyncio.sleep(window + 0.3)
                polling_after_window = sidecar.service._awake is not None
                # Idle now: the loop thread (this one) must not burn CPU.
                cpu0, wall0 = time.thread_time(), time.monotonic()
                await asyncio.sleep(0.5)
                idle_cpu = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
        finally:
            await sidecar.stop(grace=5)
        return first, again, polling_after_call, polling_after_window, idle_cpu

    first, again, polling_after_call, polling_after_window, idle_cpu = asyncio.run(main())
    np.testing.assert_array_equal(first.vectors, again.vectors)
    assert polling_after_call and not polling_after_window
    assert idle_cpu < 0.2, f"the idle loop used {idle_cpu:.0%} of a core"


def test_stop_ends_the_polling_at_once(registry):
    async def main():
        sidecar = Sidecar(registry, port=0, awake_after_call_s=3600)
        await sidecar.start()
        async with AsyncFernClient(sidecar.target, timeout=60) as client:
            await client.embed(["one query"])
        assert sidecar.service._awake is not None
        started = time.monotonic()
        await asyncio.wait_for(sidecar.stop(grace=5), 30)
        return time.monotonic() - started, sidecar.service._awake

    took, task = asyncio.run(main())
    assert task is None and took < 10


def test_zero_turns_the_polling_off(registry):
    async def main():
        sidecar = Sidecar(registry, port=0, awake_after_call_s=0)
        await sidecar.start()
        try:
            async with AsyncFernClient(sidecar.target, timeout=60) as client:
                await client.embed(["one query"])
            return sidecar.service._awake
        finally:
            await sidecar.stop(grace=5)

    assert asyncio.run(main()) is None
