"""Token-head outputs through the scheduler: asked for per request, carried per step, cut back per sequence."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import pytest

from core_engine.token_outputs import StepResult, TokenOutputs
from sidecar.scheduler import Lane, Scheduler, SchedulerConfig

DIMS = 2


class Handle:
    def __init__(self, result) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self):
        return self._result


class HeadsEngine:
    """Stand-in with token heads: a token's sparse weight is its id, its 2-wide "ColBERT" row (id, -id)."""

    def __init__(self, device: str) -> None:
        self.spec = SimpleNamespace(dimensions=DIMS)
        self.device = device
        self.prepared: list[tuple[int, bool]] = []  # (sequences, token_outputs) of every step

    def prepare(self, sequences: Sequence[Sequence[int]], token_outputs: bool = False):
        self.prepared.append((len(sequences), token_outputs))
        return [list(s) for s in sequences], token_outputs

    def replays(self, prepared) -> bool:
        return True

    def step(self, prepared) -> Handle:
        sequences, token_outputs = prepared
        pooled = np.array([[sum(s), len(s)] for s in sequences], dtype=np.float32)
        if not token_outputs:
            return Handle(pooled)
        ids = np.array([t for s in sequences for t in s], dtype=np.float32)
        values = np.stack([ids, ids, -ids], axis=1)
        cu = np.cumsum([0] + [len(s) for s in sequences])
        return Handle(StepResult(pooled, TokenOutputs(values, cu, sparse=True)))


def check_rows(sequences, rows) -> None:
    assert len(rows) == len(sequences)
    for seq, row in zip(sequences, rows):
        assert row.weights.tolist() == [float(t) for t in seq]
        assert row.multivector.tolist() == [[float(t), -float(t)] for t in seq[1:]]


@pytest.mark.parametrize("device", ["cpu:fake", "cuda:fake"])
def test_requests_with_and_without_token_outputs_share_steps_and_get_their_own(device) -> None:
    async def main():
        engine = HeadsEngine(device)
        scheduler = Scheduler([engine], SchedulerConfig(max_step_tokens=16, online_step_tokens=8,
                                                        max_step_sequences=8))
        await scheduler.start()
        wants = [[100 + i, 5, 6] for i in range(3)]
        plain = [[200 + i, 7] for i in range(2)]
        bulk = [[300 + i] + [9] * (i % 4) for i in range(20)]  # many steps, chunks across them
        a, b, c = await asyncio.gather(
            scheduler.embed(wants, Lane.ONLINE, token_outputs=True),
            scheduler.embed(plain, Lane.ONLINE),
            scheduler.embed(bulk, Lane.BATCH, token_outputs=True))
        only_plain = await scheduler.embed(plain, Lane.ONLINE)
        await scheduler.drain()
        return engine, a, b, c, only_plain

    engine, (a_pooled, a_rows), b, (c_pooled, c_rows), only_plain = asyncio.run(asyncio.wait_for(main(), 20))
    check_rows([[100 + i, 5, 6] for i in range(3)], a_rows)
    check_rows([[300 + i] + [9] * (i % 4) for i in range(20)], c_rows)
    assert c_pooled[:, 0].tolist() == [300 + i + 9 * (i % 4) for i in range(20)]
    assert isinstance(b, np.ndarray) and b[:, 0].tolist() == [207, 208]
    assert isinstance(only_plain, np.ndarray)
    assert engine.prepared[-1] == (2, False)  # a step of plain requests alone asks for no token outputs
    assert sum(n for n, _ in engine.prepared) == 3 + 2 + 20 + 2
