"""`fern serve` with every ONLINE Embed call's path through the sidecar timed, for `benchmarks.lanes_e2e --trace`.

    python -m tools.profiling.traced --out FILE [--engine-us US --engine-ns-per-token NS] serve [fern serve flags]

Everything is `fern serve`'s own; the service, gateway and scheduler methods a query passes
through are wrapped (at class level, before anything is built) to record perf_counter_ns
checkpoints (CLOCK_MONOTONIC, comparable with a client process's on Linux) of each ONLINE
Embed call:

    handler     the Embed handler is entered
    prepared    the gateway has validated and tokenized it
    admitted    the scheduler has queued it
    launched    the first engine step carrying it is launched (by_loop: from the event loop)
    delivered   the last step carrying it has been collected and its rows copied out
    resumed     the scheduler's embed returns on the event loop
    executed    the gateway has finished it (truncate, normalize, encode)
    handler_end the handler returns its response

with `crc`, the CRC-32 of its first text, by which a client matches its own send and answer
times. Every step launched is also recorded (launch time, tokens, whether it carries ONLINE
work), so the steps that ran while a slow query waited can be counted. The records are
written to FILE as JSON when the server exits. With `--engine-us`, the forward pass is
`tools.profiling.stand_in`'s.
"""

from __future__ import annotations

import argparse
import atexit
import contextvars
import functools
import json
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fern_traced_call", default=None)


class CallTrace:
    """The checkpoints of the ONLINE calls and the steps, as recorded so far."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.steps: list[tuple[int, int, bool]] = []  # (launched ns, tokens, carries ONLINE work)
        self.in_flight: dict[int, tuple[object, dict]] = {}  # id(Request) -> (the Request, its call), until delivered

    def as_json(self) -> dict:
        return {"clock": "perf_counter_ns", "calls": self.calls, "steps": self.steps}


def install(trace: CallTrace) -> None:
    """Wrap EmbedderService.Embed, Gateway.prepare/execute and the Scheduler's admission, launch and
    delivery so that each ONLINE Embed call records its checkpoints into `trace`."""
    from sidecar.gateway import Gateway
    from sidecar.lanes import Lane
    from sidecar.scheduler import Scheduler
    from sidecar.server import EmbedderService

    clock = time.perf_counter_ns

    def mark(name: str) -> None:
        call = _CURRENT.get()
        if call is not None:
            call[name] = clock()

    embed = EmbedderService.Embed

    @functools.wraps(embed)
    async def traced_embed(self, request, context):
        if request.lane != 0 or not request.texts:  # fern.v1.Lane ONLINE; pre-tokenized calls have no text
            return await embed(self, request, context)
        call = {"crc": zlib.crc32(request.texts[0].encode()), "handler": clock()}
        token = _CURRENT.set(call)
        try:
            return await embed(self, request, context)
        finally:
            call["handler_end"] = clock()
            _CURRENT.reset(token)
            trace.calls.append(call)

    EmbedderService.Embed = traced_embed

    def after(method, name: str):
        @functools.wraps(method)
        async def traced(*args, **kwargs):
            out = await method(*args, **kwargs)
            mark(name)
            return out
        return traced

    Gateway.prepare = after(Gateway.prepare, "prepared")
    Gateway.execute = after(Gateway.execute, "executed")
    Scheduler.embed = after(Scheduler.embed, "resumed")

    new_request = Scheduler._new_request

    @functools.wraps(new_request)
    def traced_new_request(self, sequences, lane, deadline):
        request = new_request(self, sequences, lane, deadline)
        call = _CURRENT.get()
        if call is not None and lane == Lane.ONLINE:
            call["admitted"] = clock()
            trace.in_flight[id(request)] = (request, call)
        return request

    Scheduler._new_request = traced_new_request

    launched = Scheduler._launched

    @functools.wraps(launched)
    def traced_launched(self, worker, step, *, by_loop=False):
        now = clock()
        online = False
        for chunk in step.chunks:
            entry = trace.in_flight.get(id(chunk.request))
            if entry is not None and entry[0] is chunk.request:
                online = True
                entry[1].setdefault("launched", now)
                entry[1].setdefault("by_loop", by_loop)
        trace.steps.append((now, step.tokens, online))
        return launched(self, worker, step, by_loop=by_loop)

    Scheduler._launched = traced_launched

    deliver = Scheduler._deliver

    @functools.wraps(deliver)
    def traced_deliver(self, worker, step, rows, *, on_loop=False):
        out = deliver(self, worker, step, rows, on_loop=on_loop)
        now = clock()
        for chunk in step.chunks:
            entry = trace.in_flight.get(id(chunk.request))
            if entry is not None and entry[0] is chunk.request:
                entry[1]["delivered"] = now
                if chunk.end == chunk.request.size:
                    trace.in_flight.pop(id(chunk.request), None)
        return out

    Scheduler._deliver = traced_deliver


def write_on_exit(trace: CallTrace, path: Path) -> None:
    atexit.register(lambda: path.write_text(json.dumps(trace.as_json())))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profiling.traced", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the records go when the server exits")
    parser.add_argument("--engine-us", type=float, default=None, help="a stand-in forward pass: a step's fixed time")
    parser.add_argument("--engine-ns-per-token", type=float, default=0.0, help="the stand-in's time per token")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not rest or rest[0] != "serve":
        parser.error("expected `serve` and fern serve's flags after the tracer's own")
    trace = CallTrace()
    install(trace)
    write_on_exit(trace, args.out)
    if args.engine_us is not None:
        from tools.profiling.stand_in import install_stand_in

        install_stand_in(args.engine_us, args.engine_ns_per_token)
    from sidecar.cli import main as fern

    return fern(rest)


if __name__ == "__main__":
    raise SystemExit(main())
