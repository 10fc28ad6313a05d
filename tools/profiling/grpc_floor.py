"""The gRPC floor: a Python round trip to a server that returns a ready Embed response, per server kind and gRPC setting.

`python -m tools.profiling.grpc_floor [--out FILE]` starts, for each variant, a bare server in
a subprocess (grpc.aio, as `fern serve` runs, or the thread-pool server) whose Embed
returns a ready 1,024-float response, and times `--iters` sequential calls from a sync
client (as FernClient) in another subprocess. Variants differ in environment settings
that gRPC reads at start (`GRPC_EXPERIMENTS`, `GRPC_POLL_STRATEGY`), set in both processes.
No engine, no tokenizer: what is left is gRPC's own cost, the floor under any end-to-end
figure of the sidecar.

The "uv ..." variants bisect the sidecar's excess over that floor, on uvloop with fern's
settings and a 384-float response: the bare server plus one sidecar ingredient at a time
(FERN_FLOOR_ADD: server options, health and reflection servicers, the loaded Registry's
threads in the process), the whole Sidecar answering with the bare handler, a handler that
waits (polled, or for a thread) as long as the sidecar's does, and the sidecar itself on the
stand-in engine of `tools.profiling.overhead --engine-us` (the bundled MiniLM's, or FERN_FLOOR_MODEL's
directory where the package is not installed). `--rounds N` runs the chosen variants N
times, interleaved, and reports each p50 and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

_NO_EE = "-event_engine_client,-event_engine_listener"
# name: (environment of both processes, of the server only, of the client only). FERN_FLOOR_LATE
# names settings applied inside the process after `import grpc` (as `fern` does in main()).
VARIANTS: dict[str, tuple[dict[str, str], dict[str, str], dict[str, str]]] = {
    "aio default": ({}, {}, {}),
    "sync-server default": ({}, {"FERN_FLOOR_SERVER": "sync"}, {}),
    "aio no-event-engine": ({"GRPC_EXPERIMENTS": _NO_EE}, {}, {}),
    "aio no-event-engine, server only": ({}, {"GRPC_EXPERIMENTS": _NO_EE}, {}),
    "aio no-event-engine, client only": ({}, {}, {"GRPC_EXPERIMENTS": _NO_EE}),
    "aio no-event-engine, set after import": ({"FERN_FLOOR_LATE": _NO_EE}, {}, {}),
    "aio no-event-engine server, client without event_engine_client": (
        {}, {"GRPC_EXPERIMENTS": _NO_EE}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
    "aio without event_engine_client, both": ({"GRPC_EXPERIMENTS": "-event_engine_client"}, {}, {}),
    "aio poll": ({"GRPC_POLL_STRATEGY": "poll"}, {}, {}),
    # fern serve's setting and a fern client's, with a handler that waits 1 ms before answering, as a
    # query waits for its GPU step: for a thread to finish it (the loop sleeps until woken), or by
    # polling between loop callbacks (the loop stays awake). The difference is what a wait costs.
    "fern settings": ({}, {"GRPC_EXPERIMENTS": _NO_EE}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
    "fern settings, handler waits 1 ms on a thread": (
        {}, {"GRPC_EXPERIMENTS": _NO_EE, "FERN_FLOOR_WAIT": "thread"}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
    "fern settings, handler polls 1 ms": (
        {}, {"GRPC_EXPERIMENTS": _NO_EE, "FERN_FLOOR_WAIT": "poll"}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
}
WAIT_S = 0.001
# What FERN_FLOOR_ADD may add to the bare server, one sidecar ingredient at a time: its server
# options, its health and reflection servicers, the loaded and started Registry (engine threads,
# scheduler, tokenizer pool) in the same process; with FERN_FLOOR_SERVER=sidecar, "bare-handler"
# keeps the whole sidecar but answers Embed as the bare server does.
INGREDIENTS = ("options", "health", "reflection", "registry", "bare-handler")
# The bisection of the sidecar's excess over the bare floor (`--only` these, `--rounds` 3): all on
# uvloop with fern's settings and MiniLM's 384-float response, as `tools.profiling.overhead --loop uvloop`.
_UV = {"GRPC_EXPERIMENTS": _NO_EE, "FERN_FLOOR_LOOP": "uvloop", "FERN_FLOOR_DIMENSIONS": "384"}
_CLIENT = {"GRPC_EXPERIMENTS": "-event_engine_client"}
VARIANTS.update({
    "uv bare": ({}, _UV, _CLIENT),
    "uv bare + options": ({}, {**_UV, "FERN_FLOOR_ADD": "options"}, _CLIENT),
    "uv bare + health + reflection": ({}, {**_UV, "FERN_FLOOR_ADD": "health,reflection"}, _CLIENT),
    "uv bare + registry": ({}, {**_UV, "FERN_FLOOR_ADD": "registry"}, _CLIENT),
    "uv sidecar, bare handler": ({}, {**_UV, "FERN_FLOOR_SERVER": "sidecar", "FERN_FLOOR_ADD": "bare-handler"},
                                 _CLIENT),
    "uv bare, polls 1 ms": ({}, {**_UV, "FERN_FLOOR_WAIT": "poll"}, _CLIENT),
    "uv bare, waits 1 ms on a thread": ({}, {**_UV, "FERN_FLOOR_WAIT": "thread"}, _CLIENT),
    "uv bare, polls 1.3 ms": ({}, {**_UV, "FERN_FLOOR_WAIT": "poll", "FERN_FLOOR_WAIT_US": "1300"}, _CLIENT),
    "uv bare + registry, polls 1.3 ms": (
        {}, {**_UV, "FERN_FLOOR_ADD": "registry", "FERN_FLOOR_WAIT": "poll", "FERN_FLOOR_WAIT_US": "1300"}, _CLIENT),
    "uv sidecar, bare handler, polls 1.3 ms": (
        {}, {**_UV, "FERN_FLOOR_SERVER": "sidecar", "FERN_FLOOR_ADD": "bare-handler", "FERN_FLOOR_WAIT": "poll",
             "FERN_FLOOR_WAIT_US": "1300"}, _CLIENT),
    "uv sidecar, engine 1 ms": ({}, {**_UV, "FERN_FLOOR_SERVER": "sidecar"}, _CLIENT),
    "uv sidecar, engine 1 ms, no loop poll": (
        {}, {**_UV, "FERN_FLOOR_SERVER": "sidecar", "FERN_ONLINE_POLL_MS": "0"}, _CLIENT),
})


def _wait_s() -> float:
    """The handler's wait: WAIT_S, or FERN_FLOOR_WAIT_US (as long as the sidecar's whole handler)."""
    return int(os.environ.get("FERN_FLOOR_WAIT_US", WAIT_S * 1e6)) / 1e6


def _late_settings() -> None:
    late = os.environ.get("FERN_FLOOR_LATE")
    if late:
        os.environ["GRPC_EXPERIMENTS"] = late


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> None:
    import grpc
    import numpy as np

    _late_settings()

    from sidecar.wire import embedder_pb2 as pb
    from sidecar.wire import embedder_pb2_grpc as pb_grpc

    if os.environ.get("FERN_FLOOR_SERVER") == "sync":
        vectors = np.zeros((1, 1024), "<f4").tobytes()

        class Sync(pb_grpc.EmbedderServicer):
            def Embed(self, request, context):
                return pb.EmbedResponse(model="bare", count=1, dimensions=1024, vectors=vectors,
                                        token_counts=[len(request.texts[0])])

        server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_EmbedderServicer_to_server(Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    mode = os.environ.get("FERN_FLOOR_WAIT")
    dimensions = int(os.environ.get("FERN_FLOOR_DIMENSIONS", "1024"))
    adds = set(filter(None, os.environ.get("FERN_FLOOR_ADD", "").split(",")))
    unknown = adds - set(INGREDIENTS)
    if unknown:
        raise SystemExit(f"FERN_FLOOR_ADD: unknown ingredient(s) {sorted(unknown)}; known: {INGREDIENTS}")

    async def main() -> None:
        from tools.profiling.overhead import _bare_server  # the floor `tools.profiling.overhead` measures too
        from sidecar.server import server_options

        if os.environ.get("FERN_FLOOR_SERVER") == "sidecar":
            await _sidecar(port, dimensions, adds, _wait(mode) if mode else None)
            return
        registry = None
        if "registry" in adds:  # the sidecar's engines, schedulers and tokenizer threads, idle
            from tools.profiling.overhead import stand_in_registry

            registry = await stand_in_registry(os.environ.get("FERN_FLOOR_MODEL"), "cpu", 1000)
            await registry.start()
        server = await _bare_server(port, dimensions, [], wait=_wait(mode) if mode else None,
                                    options=server_options() if "options" in adds else (),
                                    setup=functools.partial(_add_servicers, adds))
        await server.wait_for_termination()
        if registry is not None:
            await registry.drain()

    if os.environ.get("FERN_FLOOR_LOOP") == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _add_servicers(adds: set[str], server) -> None:
    """The servicers Sidecar.start() registers beside Embedder, as `adds` names them."""
    from grpc_health.v1 import health, health_pb2_grpc

    from sidecar.server import enable_reflection

    if "health" in adds:
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    if "reflection" in adds:
        enable_reflection(server)


async def _sidecar(port: int, dimensions: int, adds: set[str], wait) -> None:
    """The sidecar `fern serve` runs, on the stand-in engine (FERN_FLOOR_ENGINE_US, default 1,000 us);
    with "bare-handler" in `adds`, its Embed is the bare server's handler (`dimensions` floats,
    awaiting `wait` first)."""
    from tools.profiling.overhead import _bare_embed, stand_in_registry
    from sidecar.server import Sidecar

    registry = await stand_in_registry(os.environ.get("FERN_FLOOR_MODEL"), "cpu",
                                        int(os.environ.get("FERN_FLOOR_ENGINE_US", "1000")))
    sidecar = Sidecar(registry, host="127.0.0.1", port=port)
    if "bare-handler" in adds:
        sidecar.service.Embed = _bare_embed(dimensions, [], wait)
    await sidecar.start()
    await sidecar.wait_stopped()


def _wait(mode: str):
    """A coroutine function that returns WAIT_S after it is called: through a thread (standing in
    for the engine's) that finishes the wait and wakes the loop, or by polling the time between
    loop callbacks."""
    if mode == "poll":
        from tools.profiling.overhead import polling_wait

        return polling_wait(_wait_s())

    import queue
    import threading

    work: queue.SimpleQueue = queue.SimpleQueue()

    def waiter() -> None:
        while True:
            loop, future = work.get()
            time.sleep(_wait_s())
            loop.call_soon_threadsafe(future.set_result, None)

    threading.Thread(target=waiter, daemon=True).start()

    async def through_thread() -> None:
        future = asyncio.get_running_loop().create_future()
        work.put((asyncio.get_running_loop(), future))
        await future
    return through_thread


def client(port: int, iters: int) -> None:
    import grpc

    _late_settings()
    from benchmarks.stats import percentiles
    from sidecar.wire import embedder_pb2 as pb
    from sidecar.wire import embedder_pb2_grpc as pb_grpc

    stub = pb_grpc.EmbedderStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    request = pb.EmbedRequest(texts=["word " * 126])
    deadline = time.monotonic() + 30
    while True:
        try:
            stub.Embed(request, timeout=1)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    for _ in range(100):
        stub.Embed(request)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        stub.Embed(request)
        samples.append((time.perf_counter() - start) * 1e6)
    print(json.dumps(percentiles(samples, "us")))


def _measure(env: tuple[dict[str, str], dict[str, str], dict[str, str]], iters: int) -> dict:
    """One variant: its server in a subprocess, `iters` timed calls from a client subprocess."""
    both, server_env, client_env = env
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tools.profiling.grpc_floor", "--serve", str(port)],
                              env={**os.environ, **both, **server_env})
    try:
        out = subprocess.run([sys.executable, "-m", "tools.profiling.grpc_floor", "--client", str(port),
                              "--iters", str(iters)], env={**os.environ, **both, **client_env},
                             capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {
            "error": out.stderr[-500:]}
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profiling.grpc_floor", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT", help="run only these variants")
    p.add_argument("--rounds", type=int, default=1, help="run the variants this many times, interleaved")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.client is not None:
        client(args.client, args.iters)
        return 0
    from benchmarks.provenance import machine

    names = [name for name in VARIANTS if not args.only or name in args.only]
    unknown = set(args.only or ()) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--only: unknown variant(s) {sorted(unknown)}")
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):  # each round runs every variant once: load drifts hit all alike
        for name in names:
            rounds[name].append(_measure(VARIANTS[name], args.iters))
            print(name, rounds[name][-1], flush=True)
    results: dict[str, Any] = {name: runs[0] for name, runs in rounds.items()} if args.rounds == 1 else {
        name: {"p50_us_per_round": [r.get("p50_us") for r in runs],
               "p50_us_median": statistics.median(r["p50_us"] for r in runs if "p50_us" in r),
               "rounds": runs}
        for name, runs in rounds.items()}
    doc = {"command": "python -m tools.profiling.grpc_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "env": {name: VARIANTS[name] for name in names}, "round_trip": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
