"""After a unary Embed the sidecar's event loop polls for a bounded while, then sleeps again; stop() ends it.

It does so only where the loop launches and collects online steps itself (an asynchronous
engine, as on a GPU): here the CPU engine's forward pass is swapped for a stand-in whose
step() returns at once and whose rows are ready a millisecond later, as a GPU step's are.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from sidecar.client import AsyncFernClient
from sidecar.registry import ModelSource, Registry
from sidecar.server import Sidecar, awake_after_call_from_env


class _ReadyLater:
    """A stand-in step's handle: the rows are ready `delay` seconds after the launch."""

    def __init__(self, rows: np.ndarray, delay: float) -> None:
        self._rows, self._ready = rows, time.perf_counter() + delay

    def done(self) -> bool:
        return time.perf_counter() >= self._ready

    def result(self) -> np.ndarray:
        time.sleep(max(0.0, self._ready - time.perf_counter()))
        return self._rows


def _asynchronous(registry: Registry) -> Registry:
    for served in registry:
        for engine in served.engines:
            rng = np.random.default_rng(0)
            engine.step = lambda batch, d=engine.spec.dimensions: _ReadyLater(
                rng.standard_normal((batch.num_seqs, d)).astype(np.float32), 0.001)
            engine.replays = lambda batch: True
        for worker in served.scheduler._workers:
            worker.device = "cuda:stand-in"  # launches asynchronously, as a GPU engine does
    return registry


@pytest.fixture
def cpu_registry():
    """A fresh registry per test: stopping a Sidecar drains its schedulers for good."""
    return Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1)


@pytest.fixture
def registry(cpu_registry):
    return _asynchronous(cpu_registry)


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
    assert first.vectors.shape == again.vectors.shape == (2, 384)
    assert registry.get().scheduler.loop_collects_online
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


def test_no_polling_where_engine_threads_collect_the_steps(cpu_registry):
    """A polling loop would keep the GIL from the threads the next query needs."""
    async def main():
        sidecar = Sidecar(cpu_registry, port=0, awake_after_call_s=3600)
        await sidecar.start()
        try:
            async with AsyncFernClient(sidecar.target, timeout=60) as client:
                await client.embed(["one query"])
            return sidecar.service._awake
        finally:
            await sidecar.stop(grace=5)

    assert not cpu_registry.get().scheduler.loop_collects_online
    assert asyncio.run(main()) is None


@pytest.mark.parametrize("value,expected", [(None, 0.001), ("0", 0.0), ("2.5", 0.0025)])
def test_the_window_comes_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FERN_AWAKE_AFTER_CALL_MS", raising=False)
    else:
        monkeypatch.setenv("FERN_AWAKE_AFTER_CALL_MS", value)
    assert awake_after_call_from_env() == pytest.approx(expected)


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_window_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("FERN_AWAKE_AFTER_CALL_MS", value)
    with pytest.raises(ValueError, match="FERN_AWAKE_AFTER_CALL_MS"):
        awake_after_call_from_env()
