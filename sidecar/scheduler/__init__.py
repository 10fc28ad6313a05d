"""Two-lane token-budget scheduler: packs queued sequences into engine steps, one thread per engine.

One idea a file: config (SchedulerConfig), compose (the pure step composition), admission
(lanes, backpressure and waiters on the event loop), pipeline (each engine's thread), launch
(the loop-launch fast path), steps (a step's engine calls and delivery, shared by the last
two), scheduler (the Scheduler tying them), plus errors, stats, state and worker.
"""

from sidecar.lanes import Lane
from sidecar.scheduler.admission import DEADLINE_SLACK_S
from sidecar.scheduler.config import SchedulerConfig
from sidecar.scheduler.errors import DeadlineExceeded, Draining, QueueFull
from sidecar.scheduler.scheduler import Scheduler
from sidecar.scheduler.stats import EngineStats, LaneStats, SchedulerStats
from sidecar.scheduler.worker import EngineLike

__all__ = [
    "DEADLINE_SLACK_S",
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
