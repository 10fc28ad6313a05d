"""Snapshots of the scheduler's counters, for metrics, and the per-lane counters behind them."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass
class LaneCounters:
    """How one lane's requests fared so far (written under the scheduler's lock)."""

    admitted: int = 0
    rejected: int = 0
    cancelled: int = 0
    expired: int = 0
    completed: int = 0
    tokens: int = 0
