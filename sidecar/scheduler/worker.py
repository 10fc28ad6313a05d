"""The scheduler/engine seam (`EngineLike`) and one engine's worker: its thread and its load."""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

from sidecar.scheduler.compose import Step


class EngineLike(Protocol):
    """What the scheduler needs from an engine (core_engine.Engine or a test stand-in)."""

    spec: Any  # has .dimensions

    # A step carrying a request that asked for token outputs is prepared with a second
    # argument, token_outputs=True (engines whose model has token heads); its handle's result()
    # is then a core_engine.token_outputs.StepResult.
    def prepare(self, sequences: Sequence[Sequence[int]]) -> Any: ...

    def step(self, prepared: Any) -> Any: ...  # a handle with .done() and .result()


class Worker:
    """One engine, its thread, and its load (tokens composed and not yet delivered)."""

    def __init__(self, index: int, engine: EngineLike) -> None:
        self.index = index
        self.engine = engine
        self.device = str(getattr(engine, "device", "cpu"))
        self.load = 0
        self.holding = False  # a composed step not yet launched: takes no more work
        self.waiting = False  # idle: nothing in flight, waiting for work
        self.claimed = False  # the event loop is launching a step on this engine (launch on arrival)
        # That step, prepared, and its handle (None: this thread launches it), for this thread to collect.
        self.adopted: tuple[Step, Any, Any] | None = None
        self.loop_steps = 0  # steps the loop launched on this engine and is waiting for
        self.loop_launches = 0  # steps the loop launched on this engine, ever
        self.steps = 0
        self.tokens = 0
        self.sequences = 0
        self.thread: threading.Thread | None = None

    @property
    def launches_async(self) -> bool:
        """step() returns before the work is done (CUDA): results come later, from result()."""
        return self.device.startswith("cuda")
