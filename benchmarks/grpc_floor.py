"""The gRPC floor: a Python round trip to a server that returns a ready Embed response, per server kind and gRPC setting.

`python -m benchmarks.grpc_floor [--out FILE]` starts, for each variant, a bare server in
a subprocess (grpc.aio, as `fern serve` runs, or the thread-pool server) whose Embed
returns a ready 1,024-float response, and times `--iters` sequential calls from a sync
client (as FernClient) in another subprocess. Variants differ in environment settings
that gRPC reads at start (`GRPC_EXPERIMENTS`, `GRPC_POLL_STRATEGY`), set in both processes.
No engine, no tokenizer: what is left is gRPC's own cost, the floor under any end-to-end
figure of the sidecar.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

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

    async def main() -> None:
        from benchmarks.overhead import _bare_server  # the floor `benchmarks.overhead` measures too

        server = await _bare_server(port, 1024, [], wait=_wait(mode) if mode else None)
        await server.wait_for_termination()

    asyncio.run(main())


def _wait(mode: str):
    """A coroutine function that returns WAIT_S after it is called: through a thread (standing in
    for the engine's) that finishes the wait and wakes the loop, or by polling the time between
    loop callbacks."""
    if mode == "poll":
        async def poll() -> None:
            ready = time.perf_counter() + WAIT_S
            while time.perf_counter() < ready:
                await asyncio.sleep(0)
        return poll

    import queue
    import threading

    work: queue.SimpleQueue = queue.SimpleQueue()

    def waiter() -> None:
        while True:
            loop, future = work.get()
            time.sleep(WAIT_S)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_floor", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT", help="run only these variants")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.client is not None:
        client(args.client, args.iters)
        return 0
    from benchmarks.pg_common import machine

    results = {}
    for name, (both, server_env, client_env) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor", "--serve", str(port)],
                                  env={**os.environ, **both, **server_env})
        try:
            out = subprocess.run([sys.executable, "-m", "benchmarks.grpc_floor", "--client", str(port),
                                  "--iters", str(args.iters)], env={**os.environ, **both, **client_env},
                                 capture_output=True, text=True, timeout=120)
            results[name] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {
                "error": out.stderr[-500:]}
        finally:
            server.kill()
            server.wait()
        print(name, results[name], flush=True)
    doc = {"command": "python -m benchmarks.grpc_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "env": VARIANTS, "round_trip": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
