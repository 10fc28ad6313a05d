"""The loop-launch fast path: an ONLINE request that finds an asynchronous engine idle runs from the event loop.

The request is prepared on the loop as it is admitted and, when its step would replay a
captured graph, launched there too; the engine's thread is not involved (eager steps and
captures, milliseconds of host work, are left to it). The loop then waits for that step by
polling it between its other callbacks instead of sleeping until a thread wakes it. Work
arriving while that step runs goes to the engine's thread, as for a busy engine: with
several engines, only if no other is less loaded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sidecar.scheduler.compose import Step
from sidecar.scheduler.steps import FAILED, StepLifecycle
from sidecar.scheduler.worker import Worker


def _replays(prepared: Any) -> bool:
    """For engines without `replays()` (test stand-ins): every launch counts as cheap."""
    return True


class LoopLaunch(StepLifecycle):
    """Claiming an idle engine from the loop, launching a step on it, and collecting it there."""

    def _claim_locked(self) -> tuple[Worker, Step] | None:
        """An idle asynchronous engine and an online step composed for it, or None (lock held).

        The step takes online work only, within the budget of an online-only step (as the
        engine's thread would compose it): a batch step's host work does not belong on the loop.
        """
        worker = next((w for w in self._workers if w.waiting and w.launches_async
                       and not w.claimed and w.adopted is None and not w.loop_steps), None)
        if worker is None:
            return None
        step = self._online_step_locked(worker, self.config.max_step_tokens)
        if step is None:
            return None
        worker.claimed = True
        return worker, step

    def _launch_on_loop(self, worker: Worker, step: Step) -> None:
        """Prepare a claimed step here and launch it if that is cheap; then collect it here too.

        A step that would not replay a captured graph (an eager step or a capture: milliseconds
        of host work for a new shape) is handed to the engine's thread to launch, off the loop;
        so is a launched step when `online_poll_s` is 0.
        """
        engine = worker.engine
        adopted = None
        try:
            prepared = self._prepare(worker, step)
            if prepared is FAILED:
                return
            cheap = self._call(worker, step, getattr(engine, "replays", _replays), prepared)
            if cheap is FAILED:
                return
            handle = self._call(worker, step, engine.step, prepared) if cheap else None
            if handle is FAILED:
                return
            if handle is None:
                adopted = (step, prepared, None)  # the engine's thread launches it
                return
            self._launched(worker, step, by_loop=True)
            if self.config.online_poll_s > 0:
                with self._cond:
                    worker.loop_steps += 1  # busy: work arriving meanwhile goes to its thread
                task = self._loop.create_task(self._collect_on_loop(worker, step, handle))
                self._collecting.add(task)
                task.add_done_callback(self._collecting.discard)
            else:
                adopted = (step, prepared, handle)
        finally:  # whatever happened, the claim ends; the engine's thread is woken only if it has work
            with self._cond:
                worker.claimed = False
                worker.adopted = adopted
                if adopted is not None or self._has_work_locked():
                    self._cond.notify_all()

    async def _collect_on_loop(self, worker: Worker, step: Step, handle: Any) -> None:
        """Wait for a step the loop launched, polling it between the loop's other callbacks, and deliver it.

        A step still running after `online_poll_s` is waited for on a thread instead. The task is
        not the caller's: a cancelled request does not stop it (its step may carry other requests).
        """
        give_up = time.monotonic() + self.config.online_poll_s
        try:
            while True:
                done = self._call(worker, step, handle.done)
                if done is FAILED:
                    return
                if done:
                    rows = self._call(worker, step, handle.result)
                    break
                if time.monotonic() > give_up:
                    rows = await asyncio.to_thread(self._call, worker, step, handle.result)
                    break
                await asyncio.sleep(0)
        finally:
            with self._cond:
                worker.loop_steps -= 1
        if rows is not FAILED:
            self._deliver(worker, step, rows, on_loop=True)
