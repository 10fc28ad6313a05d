"""Step composition as a pure function: queued lanes, a budget and the time in; a step and the expired out.

The functions take the step's chunks off the lane queues they are given and touch nothing
else: the caller marks and posts the expired requests and charges the step to a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from sidecar.lanes import Chunk, Lane, LaneQueue, Request
from sidecar.scheduler.config import SchedulerConfig


@dataclass(eq=False)
class Step:
    """The chunks one engine step carries, in the order of `sequences`."""

    chunks: list[Chunk]
    sequences: list[Sequence[int]]
    tokens: int


class Composed(NamedTuple):
    """What a composition took: the step to run (None: nothing left) and requests found expired."""

    step: Step | None
    expired: list[Request]


def compose(lanes: Mapping[Lane, LaneQueue], config: SchedulerConfig, now: float) -> Composed:
    """The next step from both lanes: ONLINE first, BATCH filling what is left.

    ONLINE takes up to `max_step_tokens`; when it took anything, the step is capped at
    `online_step_tokens` so the query's own step stays short, and BATCH fills the rest of
    that cap; with no ONLINE work BATCH gets the whole `max_step_tokens`. A first sequence
    longer than the budget is taken alone only into an empty step. Both lanes share the
    `max_step_sequences` slots. Requests whose deadline is at or before `now` are taken off
    the lanes and returned in `expired`, never in the step.
    """
    online = lanes[Lane.ONLINE].take(config.max_step_tokens, config.max_step_sequences, now, oversize_ok=True)
    batch_budget = max(0, config.online_step_tokens - online.tokens) if online.chunks else config.max_step_tokens
    batch = lanes[Lane.BATCH].take(
        batch_budget,
        config.max_step_sequences - online.sequences,
        now,
        oversize_ok=not online.chunks,
    )
    expired = online.expired + batch.expired
    chunks = online.chunks + batch.chunks
    if not chunks:
        return Composed(None, expired)
    return Composed(_step(chunks, online.tokens + batch.tokens), expired)


def compose_online(online: LaneQueue, budget: int, max_sequences: int, now: float) -> Composed:
    """A step of ONLINE work only, up to `budget` tokens and `max_sequences` sequences."""
    took = online.take(budget, max_sequences, now, oversize_ok=True)
    if not took.chunks:
        return Composed(None, took.expired)
    return Composed(_step(took.chunks, took.tokens), took.expired)


def _step(chunks: list[Chunk], tokens: int) -> Step:
    sequences: list[Sequence[int]] = []
    for chunk in chunks:
        sequences.extend(chunk.request.sequences[chunk.start : chunk.end])
    return Step(chunks, sequences, tokens)
