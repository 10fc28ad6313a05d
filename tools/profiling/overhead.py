"""Measures the sidecar's own per-request cost: a gRPC round trip minus the engine work it wraps, by stage.

`python -m tools.profiling.overhead` starts a sidecar in a subprocess (`--serve`: the same
Registry + Sidecar that `fern serve` builds, real gRPC on loopback, the bundled MiniLM
unless --model says otherwise) and, in this process, the same engine. For each text
length it interleaves, request by request and in alternating order so that load on a
shared machine hits both alike: (a) `engine.embed([ids])` here (prepare + step + result
for the same one text) and (b) `FernClient.embed([text])` against the sidecar.

The sidecar records perf_counter_ns checkpoints (CLOCK_MONOTONIC, comparable across
processes on Linux) at each stage of every Embed call, and the engine calls its
scheduler makes. So besides p50(b) − p50(a), every request also has its own overhead:
round trip minus the engine time spent on that very request in the server, split into

    grpc_in     client send -> Embed handler entered (client + transport + server grpc + loop)
    prepare     handler -> gateway.prepare done (validation, prompt, tokenization)
    hand_off    scheduler.embed called -> engine.prepare starts on the engine thread
    engine      engine.prepare + step + result (what the GPU/CPU work costs)
    hand_back   result out of the engine -> scheduler.embed returns on the loop
    finalize    -> gateway.execute done (truncate/normalize/encode)
    respond     -> handler returns (response message built)
    grpc_out    handler return -> client has decoded the response

On the 2-core CI box every wall-clock stage is 2-4x its warm in-process cost: the
engine's 10-40 ms of torch on the same cores (here, and in the sidecar's own engine
thread) evicts the sidecar's code and data from the caches, and other tenants' load
adds wake-up delays. The sidecar's own work is also given as CPU time: `sidecar_cpu` is
the sidecar process's CPU time (all threads: gRPC, event loop, scheduler) from one Embed
call's start to the next one's, minus the engine calls' own thread CPU time; `loop_cpu`
the event loop thread's CPU time per request (gRPC aio's Python side, gateway,
tokenization, scheduler calls), to be read beside `bare_loop_cpu`, the same for the bare
server. `bare_grpc` is the floor: a round trip to an aio server (own process) whose
Embed returns a ready response of the same size. `bare_stages` splits its round trips as
the sidecar's are (grpc_in, handler, grpc_out). On a VM gRPC's own stages grow with the
time the handler takes (wake-ups from idle cost more after a longer wait: measured on the
2-core KVM box, a 1.3 ms handler adds ~120 µs to grpc_in and ~40 to grpc_out, with no
sidecar code involved), so the sidecar's grpc_in/grpc_out are to be read beside a floor
whose handler takes as long: `--bare-wait-us N` makes the bare Embed poll N µs before it
answers, as the sidecar's loop polls its step.

After the interleaved part, each length also runs `--iters` engine calls, then bare
calls, then sidecar calls back to back (`back_to_back`), as `fern bench`'s latency part
calls the sidecar.

`--loop uvloop` runs both servers on uvloop's event loop instead of asyncio's.

`--engine-us N` swaps the engines' forward pass (here and in the sidecar) for a stand-in
whose result is ready N microseconds after `step()` returns, as a GPU step's event is:
the sidecar's own path then runs as it does beside a GPU (its threads idle while the step
runs, no CPU forward pass evicting its caches), so changes to it can be compared on a CPU
machine. Only the engine stage is simulated; everything else is the real sidecar.

The checkpoint wrappers cost well under a microsecond each (measured: `checkpoint_ns`).
Results go to benchmarks/results/<device>/overhead.json with the command, machine and date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from benchmarks.provenance import code_identity
from benchmarks.stats import percentiles
from sidecar.cli import GRPC_EXPERIMENTS

LENGTHS = (16, 128)


# ----------------------------------------------------------------------------- server side

@dataclass
class Trace:
    """Checkpoints of every Embed call and every engine call, in the order they happened."""

    calls: list[dict[str, int]] = field(default_factory=list)
    engine: list[tuple[int, int, int]] = field(default_factory=list)  # (prepare start, result end, CPU ns)


def _instrument(sidecar, trace: Trace) -> None:
    """Wrap the service, gateway, scheduler and engines of `sidecar` with checkpoints."""
    clock = time.perf_counter_ns
    service, gateway = sidecar.service, sidecar.gateway
    current: dict[str, int] = {}

    handler = service.Embed

    @functools.wraps(handler)
    async def embed(request, context):
        current.clear()
        current["handler"] = clock()
        current["cpu"] = time.process_time_ns()
        current["loop_cpu"] = time.thread_time_ns()
        try:
            return await handler(request, context)
        finally:
            current["handler_end"] = clock()
            trace.calls.append(dict(current))

    service.Embed = embed

    prepare = gateway.prepare

    async def timed_prepare(params):
        out = await prepare(params)
        current["prepared"] = clock()
        return out

    gateway.prepare = timed_prepare
    execute = gateway.execute

    async def timed_execute(prepared, **kw):
        out = await execute(prepared, **kw)
        current["executed"] = clock()
        return out

    gateway.execute = timed_execute

    for served in sidecar.registry:
        scheduler_embed = served.scheduler.embed

        async def timed_embed(*a, _inner=scheduler_embed, **kw):
            current["scheduled"] = clock()
            out = await _inner(*a, **kw)
            current["resumed"] = clock()
            return out

        served.scheduler.embed = timed_embed
        for engine in served.engines:
            _instrument_engine(engine, trace)


def _instrument_engine(engine, trace: Trace) -> None:
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    prepare, step = engine.prepare, engine.step

    def timed_prepare(sequences):
        started, cpu0 = clock(), cpu()
        batch = prepare(sequences)
        batch._fern_started = started
        batch._fern_cpu = cpu() - cpu0
        return batch

    def timed_step(batch):
        cpu0 = cpu()
        handle = step(batch)
        used = getattr(batch, "_fern_cpu", 0) + cpu() - cpu0
        return _TimedHandle(handle, getattr(batch, "_fern_started", clock()), used, trace)

    engine.prepare, engine.step = timed_prepare, timed_step


class _ReadyAt:
    """A stand-in step's handle: zeros, ready at a perf_counter() instant (`--engine-us`)."""

    def __init__(self, rows: np.ndarray, ready: float) -> None:
        self._rows, self._ready = rows, ready

    def done(self) -> bool:
        return time.perf_counter() >= self._ready

    def result(self) -> np.ndarray:
        wait = self._ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # releases the GIL, as an event wait does
        return self._rows


def _stand_in_forward(engine, seconds: float, per_token: float = 0.0) -> None:
    """Make `engine.step` return at once with a handle ready `seconds` (+ `per_token` seconds for each of the
    step's tokens) later, as a GPU step's event is; prepare stays real."""
    dimensions = engine.spec.dimensions

    def step(batch):
        rows = np.zeros((batch.num_seqs, dimensions), dtype=np.float32)
        return _ReadyAt(rows, time.perf_counter() + seconds + per_token * batch.num_tokens)

    engine.step = step
    engine.replays = lambda batch: True  # its step() is a cheap launch, as a graph replay is


class _TimedHandle:
    """An engine handle that records (prepare start, result end) when its result is taken."""

    def __init__(self, handle, started: int, cpu_ns: int, trace: Trace) -> None:
        self._handle, self._started, self._cpu, self._trace = handle, started, cpu_ns, trace

    def done(self) -> bool:
        return self._handle.done()

    def result(self) -> np.ndarray:
        cpu0 = time.thread_time_ns()
        rows = self._handle.result()
        self._trace.engine.append((self._started, time.perf_counter_ns(),
                                   self._cpu + time.thread_time_ns() - cpu0))
        return rows


def _bare_embed(dimensions: int, loop_cpu: list[int], wait: Callable[[], Awaitable[None]] | None = None,
                marks: list[tuple[int, int]] | None = None):
    """The bare server's Embed handler: a ready response of `dimensions` float32s.

    `marks`, if given, gets each call's (handler entered, handler returns) perf_counter_ns."""
    from sidecar.wire import embedder_pb2 as pb

    vectors = np.zeros((1, dimensions), "<f4").tobytes()

    async def Embed(request, context):
        entered = time.perf_counter_ns()
        loop_cpu.append(time.thread_time_ns())
        if wait is not None:
            await wait()
        response = pb.EmbedResponse(model="bare", count=1, dimensions=dimensions, vectors=vectors,
                                    token_counts=[len(request.texts[0])])
        if marks is not None:
            marks.append((entered, time.perf_counter_ns()))
        return response

    return Embed


def polling_wait(seconds: float) -> Callable[[], Awaitable[None]]:
    """A wait of `seconds` that polls the clock between loop callbacks, as the sidecar's loop
    polls a step it launched (Scheduler._collect_on_loop): the loop stays awake meanwhile."""
    async def poll() -> None:
        ready = time.perf_counter() + seconds
        while time.perf_counter() < ready:
            await asyncio.sleep(0)
    return poll


async def _bare_server(port: int, dimensions: int, loop_cpu: list[int],
                       wait: Callable[[], Awaitable[None]] | None = None, *,
                       options: Sequence[tuple[str, Any]] = (),
                       setup: Callable[[Any], None] | None = None,
                       marks: list[tuple[int, int]] | None = None):
    """The gRPC floor: an aio server whose Embed returns a ready response of the same size.

    `loop_cpu` gets the event loop thread's CPU time at each call's start; `wait`, if given,
    is awaited before each reply (tools/profiling/grpc_floor.py: what a wait costs a call);
    `options` and `setup` (called with the server before it starts) add the sidecar's server
    options and servicers one at a time (grpc_floor's bisection variants)."""
    import grpc.aio

    from sidecar.wire import embedder_pb2_grpc as pb_grpc

    class Bare(pb_grpc.EmbedderServicer):
        pass

    bare = Bare()
    bare.Embed = _bare_embed(dimensions, loop_cpu, wait, marks)
    server = grpc.aio.server(options=list(options))
    pb_grpc.add_EmbedderServicer_to_server(bare, server)
    if setup is not None:
        setup(server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def stand_in_registry(model: str | None, device: str, engine_us: int):
    """The Registry `fern serve` loads; with `engine_us`, its engines' forward pass is the stand-in."""
    from core_engine.settings import SidecarConfig
    from sidecar.registry import ModelSource, Registry

    registry = await asyncio.to_thread(Registry.load, [ModelSource(Path(model) if model else None)],
                                       device=device, settings=SidecarConfig.from_env())
    return with_stand_in(registry, engine_us) if engine_us else registry


def with_stand_in(registry, engine_us: float, engine_ns_per_token: float = 0.0):
    """`registry` with every engine's forward pass the stand-in: ready `engine_us` + `engine_ns_per_token`
    per token after step(), and schedulers that collect it as they collect a CUDA engine's steps."""
    from sidecar.registry import Registry, ServedModel
    from sidecar.scheduler import Scheduler

    models = []
    for served in registry:
        for engine in served.engines:
            _stand_in_forward(engine, engine_us / 1e6, engine_ns_per_token / 1e9)
        # The stand-in's step() returns before its result is ready, as a GPU step does: its
        # scheduler is built over engines that say so, as it would be over CUDA engines.
        engines = [_AsyncStandIn(engine) for engine in served.engines]
        models.append(ServedModel(served.spec, served.tokenizer, Scheduler(engines, served.scheduler.config),
                                  served.engines))
    return Registry(models)


class _AsyncStandIn:
    """An engine whose device reads as CUDA's, so the scheduler collects its steps asynchronously."""

    device = "cuda:stand-in"

    def __init__(self, engine) -> None:
        self.engine, self.spec = engine, engine.spec

    def prepare(self, sequences):
        return self.engine.prepare(sequences)

    def step(self, prepared):
        return self.engine.step(prepared)

    def __getattr__(self, name: str):  # replays(), counters and the rest: the engine's own
        return getattr(self.engine, name)


async def serve(args: argparse.Namespace) -> None:
    """The sidecar of `fern serve` (one model, `--device`), instrumented; trace to --trace on SIGTERM.

    With --bare, only the bare gRPC floor server (its own process, so that the sidecar
    process's CPU time counts the sidecar's requests alone)."""
    from sidecar.server import Sidecar

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if args.bare:
        loop_cpu: list[int] = []
        marks: list[tuple[int, int]] = []
        wait = polling_wait(args.bare_wait_us / 1e6) if args.bare_wait_us else None
        bare = await _bare_server(args.port, args.dimensions, loop_cpu, wait, marks=marks)
        await stop.wait()
        await bare.stop(0)
        Path(args.trace).write_text(json.dumps({"loop_cpu": loop_cpu, "marks": marks}))
        return
    registry = await stand_in_registry(args.model, args.device, args.engine_us)
    sidecar = Sidecar(registry, host="127.0.0.1", port=args.port, token=args.token)
    trace = Trace()
    if not args.no_trace:
        _instrument(sidecar, trace)
    await sidecar.start()
    print(f"overhead: serving on {sidecar.target}", file=sys.stderr, flush=True)
    await stop.wait()
    await sidecar.stop(5.0)
    Path(args.trace).write_text(json.dumps({"calls": trace.calls, "engine": trace.engine}))


# ----------------------------------------------------------------------------- driver side

def _percentiles(samples_ns: list[int] | np.ndarray) -> dict[str, float]:
    return percentiles(np.asarray(samples_ns, dtype=np.float64) / 1e3, "us", digits=1)


def _start_server(args: argparse.Namespace, trace_path: Path, log_path: Path, *,
                  bare_dimensions: int = 0) -> tuple[subprocess.Popen, str]:
    """The instrumented sidecar (or, with `bare_dimensions`, the bare floor) in a subprocess."""
    from benchmarks.server import free_port
    from sidecar.client import FernClient, FernError

    port = free_port()
    command = [sys.executable, "-m", "tools.profiling.overhead", "--serve", "--port", str(port),
               "--trace", str(trace_path), "--device", args.device]
    if bare_dimensions:
        command += ["--bare", "--dimensions", str(bare_dimensions), "--bare-wait-us", str(args.bare_wait_us)]
    if args.model:
        command += ["--model", args.model]
    if args.token:
        command += ["--token", args.token]
    if args.no_trace:
        command += ["--no-trace"]
    if args.engine_us:
        command += ["--engine-us", str(args.engine_us)]
    if args.loop != "asyncio":
        command += ["--loop", args.loop]
    # Both servers run with the gRPC setting `fern serve` applies to itself (or --server-grpc);
    # this process's own GRPC_EXPERIMENTS (gRPC's defaults when unset) is the client's.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads),
               GRPC_EXPERIMENTS=args.server_grpc)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    started = time.monotonic()
    with FernClient(target) as client:
        while True:
            if bare_dimensions:
                try:
                    client.embed(["ready?"], timeout=1.0)
                    break
                except FernError:  # not listening yet
                    time.sleep(0.1)
                    continue
            elif client.health(timeout=1.0):
                break
            if process.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {process.returncode}; see {log_path}")
            if time.monotonic() - started > 300:
                process.kill()
                raise TimeoutError(f"the sidecar was not SERVING after 300 s; see {log_path}")
            time.sleep(0.1)
    return process, target


def _wrapper_cost_ns() -> int:
    """What one checkpoint (a clock read and a dict store) costs here, median of many."""
    clock, d, samples = time.perf_counter_ns, {}, []
    for _ in range(2000):
        t0 = clock()
        d["x"] = clock()
        samples.append(clock() - t0)
    return int(np.median(samples))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.texts import make_texts
    from core_engine.engine import Engine
    from sidecar.client import FernClient

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = Path(f"/tmp/fern-overhead-trace-{os.getpid()}.json")
    log_path = Path(f"/tmp/fern-overhead-sidecar-{os.getpid()}.log")
    engine = Engine(args.model, device=args.device)
    if args.engine_us:
        _stand_in_forward(engine, args.engine_us / 1e6)
    process, target = _start_server(args, trace_path, log_path)
    bare_trace_path = trace_path.with_suffix(".bare.json")
    bare_process, bare_target = _start_server(args, bare_trace_path, log_path.with_suffix(".bare.log"),
                                              bare_dimensions=engine.spec.dimensions)
    clock = time.perf_counter_ns
    sends: list[tuple[int, int]] = []  # every client Embed call, warm-up included, in order
    plan: list[tuple[int, int]] = []  # (length, index into sends) of measured calls
    engine_ns: dict[int, list[int]] = {n: [] for n in args.lengths}
    e2e_ns: dict[int, list[int]] = {n: [] for n in args.lengths}
    bare_ns: dict[int, list[int]] = {n: [] for n in args.lengths}
    bare_plan: list[tuple[int, int]] = []  # (length, index of the bare call, readiness probes excluded)
    bare_calls = 0
    bare_sends: list[tuple[int, int]] = []  # every bare call, warm-up included, in order
    bare_b2b_plan: list[tuple[int, int]] = []
    # Back to back (no interleaving: the sidecar stays warm, as in `fern bench`'s latency part).
    b2b: dict[int, dict[str, list[int]]] = {n: {"engine": [], "bare": [], "e2e": []} for n in args.lengths}
    b2b_plan: list[tuple[int, int]] = []
    tokens: dict[int, int] = {}
    try:
        with FernClient(target, token=args.token) as client, FernClient(bare_target) as bare:
            for length in args.lengths:
                texts = make_texts(engine.spec.tokenizer_path, [length] * 8, seed=length)
                ids = _ids(engine, texts)  # tokenized as the sidecar does
                tokens[length] = len(ids[0])
                for i in range(args.warmup):
                    engine.embed([ids[i % 8]])
                    t0 = clock()
                    bare.embed([texts[i % 8]])
                    bare_sends.append((t0, clock()))
                    bare_calls += 1
                    t0 = clock()
                    client.embed([texts[i % 8]])
                    sends.append((t0, clock()))
                for i in range(args.iters):
                    order = ((0, 1, 2), (1, 2, 0), (2, 0, 1))[i % 3]
                    for which in order:
                        if which == 0:
                            t0 = clock()
                            engine.embed([ids[i % 8]])
                            engine_ns[length].append(clock() - t0)
                        elif which == 2:
                            t0 = clock()
                            bare.embed([texts[i % 8]])
                            t1 = clock()
                            bare_sends.append((t0, t1))
                            bare_ns[length].append(t1 - t0)
                            bare_plan.append((length, bare_calls))
                            bare_calls += 1
                        else:
                            t0 = clock()
                            client.embed([texts[i % 8]])
                            t1 = clock()
                            sends.append((t0, t1))
                            e2e_ns[length].append(t1 - t0)
                            plan.append((length, len(sends) - 1))
                for i in range(args.iters):
                    t0 = clock()
                    engine.embed([ids[i % 8]])
                    b2b[length]["engine"].append(clock() - t0)
                for i in range(args.iters):
                    t0 = clock()
                    bare.embed([texts[i % 8]])
                    t1 = clock()
                    bare_sends.append((t0, t1))
                    b2b[length]["bare"].append(t1 - t0)
                    bare_b2b_plan.append((length, bare_calls))
                    bare_calls += 1
                for i in range(args.iters):
                    t0 = clock()
                    client.embed([texts[i % 8]])
                    t1 = clock()
                    sends.append((t0, t1))
                    b2b[length]["e2e"].append(t1 - t0)
                    b2b_plan.append((length, len(sends) - 1))
    finally:
        for p in (process, bare_process):
            p.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        bare_process.wait(timeout=60)
    trace = json.loads(trace_path.read_text()) if trace_path.exists() and not args.no_trace else None
    bare_trace = json.loads(bare_trace_path.read_text())
    bare_cpu = bare_trace["loop_cpu"]
    bare_marks = bare_trace["marks"][len(bare_trace["marks"]) - bare_calls:]  # readiness probes first
    results: dict[str, Any] = {}
    for length in args.lengths:
        entry: dict[str, Any] = {
            "tokens": tokens[length],
            "engine_here": _percentiles(engine_ns[length]),
            "e2e": _percentiles(e2e_ns[length]),
            "e2e_minus_engine_p50_us": round((np.median(e2e_ns[length]) - np.median(engine_ns[length])) / 1e3, 1),
            "bare_grpc": _percentiles(bare_ns[length]),
            "e2e_minus_engine_minus_bare_p50_us": round((np.median(e2e_ns[length]) - np.median(engine_ns[length])
                                                          - np.median(bare_ns[length])) / 1e3, 1),
            "e2e_minus_engine_p99_us": round((np.percentile(e2e_ns[length], 99)
                                              - np.percentile(engine_ns[length], 99)) / 1e3, 1),
        }
        # The bare server saw readiness probes first: count from the end.
        offset = len(bare_cpu) - bare_calls
        cycles = [bare_cpu[offset + k + 1] - bare_cpu[offset + k] for n, k in bare_plan
                  if n == length and offset + k + 1 < len(bare_cpu)]
        entry["bare_loop_cpu"] = _percentiles(cycles)
        entry["bare_stages"] = _bare_stages(bare_marks, bare_sends, [k for n, k in bare_plan if n == length])
        if trace is not None:
            entry.update(_stages(trace, sends, [k for n, k in plan if n == length]))
        warm = {k: _percentiles(v) for k, v in b2b[length].items()}
        warm["e2e_minus_engine_p50_us"] = round((np.median(b2b[length]["e2e"])
                                                 - np.median(b2b[length]["engine"])) / 1e3, 1)
        if trace is not None:
            warm.update(_stages(trace, sends, [k for n, k in b2b_plan if n == length]))
        warm["bare_stages"] = _bare_stages(bare_marks, bare_sends, [k for n, k in bare_b2b_plan if n == length])
        entry["back_to_back"] = warm
        results[str(length)] = entry
    return {
        "command": " ".join(["python -m tools.profiling.overhead", *sys.argv[1:]]),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"hostname": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "grpcio": __import__("grpc").__version__, "torch_threads": args.threads,
                    "device": args.device},
        **code_identity(),
        "model": engine.spec.name,
        "engine_stand_in_us": args.engine_us or None,
        "server_event_loop": args.loop,
        "server_grpc_experiments": args.server_grpc,
        "client_grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
        "iters": args.iters,
        "bare_wait_us": args.bare_wait_us,
        "checkpoint_ns": _wrapper_cost_ns(),
        "lengths": results,
    }


def _ids(engine, texts: list[str]) -> list[list[int]]:
    from sidecar.tokenize import TextTokenizer

    return TextTokenizer.for_spec(engine.spec, workers=1).encode(texts)


def _bare_stages(marks: list[list[int]], sends: list[tuple[int, int]], measured: list[int]) -> dict[str, Any]:
    """The bare calls' round trips split as the sidecar's are: grpc_in, handler, grpc_out."""
    if len(marks) != len(sends):
        return {"stages_error": f"{len(marks)} bare calls traced, {len(sends)} sent"}
    split: dict[str, list[int]] = {"grpc_in": [], "handler": [], "grpc_out": []}
    for k in measured:
        (t0, t1), (h0, h1) = sends[k], marks[k]
        if not t0 <= h0 <= h1 <= t1:
            return {"stages_error": f"bare call {k} does not nest in its client call: clocks differ?"}
        split["grpc_in"].append(h0 - t0)
        split["handler"].append(h1 - h0)
        split["grpc_out"].append(t1 - h1)
    return {k: _percentiles(v) for k, v in split.items()}


def _stages(trace: dict[str, Any], sends: list[tuple[int, int]], measured: list[int]) -> dict[str, Any]:
    """Per-request stage durations, matched to client calls by order (one call at a time)."""
    calls, engine_calls = trace["calls"], trace["engine"]
    if len(calls) != len(sends):
        return {"stages_error": f"{len(calls)} Embed calls traced, {len(sends)} sent"}
    stages: dict[str, list[int]] = {k: [] for k in (
        "grpc_in", "prepare", "hand_off", "engine", "hand_back", "finalize", "respond", "grpc_out",
        "overhead", "sidecar_cpu", "loop_cpu")}
    starts = np.array([e[0] for e in engine_calls], dtype=np.int64)
    for k in measured:
        (t0, t1), c = sends[k], calls[k]
        if not t0 <= c["handler"] <= c["handler_end"] <= t1:
            return {"stages_error": f"call {k} does not nest in its client call: clocks differ?"}
        j = int(np.searchsorted(starts, c["scheduled"]))
        e0, e1, engine_cpu = engine_calls[j]
        stages["grpc_in"].append(c["handler"] - t0)
        stages["prepare"].append(c["prepared"] - c["handler"])
        stages["hand_off"].append(e0 - c["scheduled"])
        stages["engine"].append(e1 - e0)
        stages["hand_back"].append(c["resumed"] - e1)
        stages["finalize"].append(c["executed"] - c["resumed"])
        stages["respond"].append(c["handler_end"] - c["executed"])
        stages["grpc_out"].append(t1 - c["handler_end"])
        stages["overhead"].append((t1 - t0) - (e1 - e0))
        if k + 1 < len(calls):  # the sidecar process's CPU from this call's start to the next's
            stages["sidecar_cpu"].append(calls[k + 1]["cpu"] - c["cpu"] - engine_cpu)
            stages["loop_cpu"].append(calls[k + 1]["loop_cpu"] - c["loop_cpu"])
    return {"stages": {k: _percentiles(v) for k, v in stages.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profiling.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled MiniLM)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both processes")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--token", default=None, help="run the sidecar with auth on (as production does)")
    p.add_argument("--no-trace", action="store_true", help="no checkpoint wrappers in the sidecar")
    p.add_argument("--engine-us", type=int, default=0,
                   help="stand-in forward pass ready this many us after step() (0: the real engine)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/<device type>/overhead.json)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop of the sidecar and bare servers (uvloop: if installed)")
    p.add_argument("--server-grpc", default=GRPC_EXPERIMENTS,
                   help="GRPC_EXPERIMENTS of both servers (default: fern serve's own setting); the "
                        "client takes this process's GRPC_EXPERIMENTS")
    p.add_argument("--bare-wait-us", type=int, default=0,
                   help="the bare server's Embed polls this long before it answers, as the sidecar's loop "
                        "polls its step: gRPC's own stages grow with the handler's time on a VM")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dimensions", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(serve(args))
        else:
            asyncio.run(serve(args))
        return 0
    if args.out is None:
        args.out = f"benchmarks/results/{args.device.split(':')[0]}/overhead.json"
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {"e2e_p50_us": v["e2e"]["p50_us"], "engine_p50_us": v["engine_here"]["p50_us"],
                          "diff_p50_us": v["e2e_minus_engine_p50_us"],
                          "bare_grpc_p50_us": v["bare_grpc"]["p50_us"],
                          "bare_loop_cpu_p50_us": v["bare_loop_cpu"]["p50_us"],
                          "bare_stages_p50_us": {s: x.get("p50_us") for s, x in v["bare_stages"].items()},
                          "fern_over_floor_p50_us": v["e2e_minus_engine_minus_bare_p50_us"],
                          "stages_p50_us": {s: x["p50_us"] for s, x in v.get("stages", {}).items()},
                          "back_to_back_p50_us": {
                              "e2e": v["back_to_back"]["e2e"]["p50_us"],
                              "engine": v["back_to_back"]["engine"]["p50_us"],
                              "bare": v["back_to_back"]["bare"]["p50_us"],
                              "bare_stages": {s: x.get("p50_us")
                                              for s, x in v["back_to_back"]["bare_stages"].items()},
                              "stages": {s: x["p50_us"]
                                         for s, x in v["back_to_back"].get("stages", {}).items()}}}
                      for k, v in result["lengths"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
