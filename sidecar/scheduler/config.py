"""The scheduler's one frozen configuration: step budgets, queue bounds and the loop-launch switches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.lanes import Lane

# Budgets for a CPU engine: a CPU step computes on the caller's clock, so steps are kept short.
_CPU_DEFAULTS: dict[str, Any] = dict(
    max_step_tokens=512,
    online_step_tokens=128,
    max_step_sequences=256,
    max_queued_tokens_online=16_384,
    max_queued_tokens_batch=65_536,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budgets and queue bounds, in tokens, and the event loop's launch fast path.

    Defaults are for a GPU with a small encoder (MiniLM-class). Throughput per token is flat
    above about 512 tokens a step, so budgets are set for latency: a BATCH step bounds how
    long an arriving query waits for the step in flight, and a step that carries ONLINE work
    is capped at `online_step_tokens` (online first, then batch fill) so the query's own step
    is short too. `for_device("cpu")` scales the budgets down. Nothing here reads the
    environment: the edge (the CLI) builds one and passes it in.
    """

    max_step_tokens: int = 8192  # budget of a step (pure BATCH, or ONLINE alone)
    online_step_tokens: int = 2048  # cap of a step that carries ONLINE work plus batch fill
    max_step_sequences: int = 1024  # sequence slots in one step
    max_queued_tokens_online: int = 65_536  # ONLINE backlog before QueueFull
    max_queued_tokens_batch: int = 262_144  # BATCH backlog before QueueFull / stream waits
    # An ONLINE request that finds an asynchronous (CUDA) engine idle is prepared and launched
    # on the event loop as it is admitted, instead of waking the engine's thread to do it.
    launch_on_arrival: bool = True
    # The loop then polls that step's result between its other callbacks for up to this long
    # (then a thread waits), staying awake instead of sleeping until a thread wakes it.
    # 0: the engine's thread collects it.
    online_poll_s: float = 0.020

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
    def for_device(cls, device_type: str, **overrides: Any) -> SchedulerConfig:
        """Defaults for an engine on `device_type` ("cuda" or "cpu"), with overrides."""
        base = dict(_CPU_DEFAULTS) if device_type == "cpu" else {}
        base.update(overrides)
        return cls(**base)

    def bound(self, lane: Lane) -> int:
        """The most tokens `lane` may hold queued."""
        return self.max_queued_tokens_online if lane == Lane.ONLINE else self.max_queued_tokens_batch
