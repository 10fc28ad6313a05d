"""Batch-1 overhead of candidate ASGI stacks for the HTTP door, side by side, with the same embed-shaped handler.

Each stack serves one route in its own process: parse a JSON `{"input": "...", "model": "..."}`
body, answer an OpenAI-shaped response whose embedding is a fixed 384-dim float32 vector in
base64 (what the OpenAI SDK asks for). No model runs, so the figures are the stack's own cost
per request. The client is http.client on one keep-alive connection, in this process; rounds
interleave the stacks so a noisy neighbour slows them all alike.

    python -m benchmarks.http_stacks --requests 1000 --rounds 5 --out benchmarks/results/cpu/http-stacks.json
"""

# No `from __future__ import annotations`: FastAPI reads the handler's annotations at run time.
import argparse
import base64
import http.client
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.server import free_port

STACKS = ("raw-asgi+uvicorn-httptools", "starlette+uvicorn-httptools", "starlette-direct+uvicorn-httptools",
          "starlette+uvicorn-h11", "fastapi+uvicorn-httptools", "starlette+granian-embedded")
VECTOR_B64 = base64.b64encode(np.linspace(-1, 1, 384, dtype="<f4").tobytes()).decode()


def _answer(payload: dict) -> bytes:
    body = {"object": "list", "model": payload.get("model", ""),
            "data": [{"object": "embedding", "index": 0, "embedding": VECTOR_B64}],
            "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    return json.dumps(body, separators=(",", ":")).encode()


def raw_app():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = _answer(json.loads(b"".join(chunks)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return app


def starlette_app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def embeddings(request: Request) -> Response:
        return Response(_answer(json.loads(await request.body())), media_type="application/json")

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])


def starlette_direct_app():
    """Starlette's Request and Response, dispatched by a dict of exact paths (Fern's HttpApp fast path)."""
    from starlette.requests import Request
    from starlette.responses import Response

    async def embeddings(request: Request) -> Response:
        return Response(_answer(json.loads(await request.body())), media_type="application/json")

    routes = {("POST", "/v1/embeddings"): embeddings}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        endpoint = routes[(scope["method"], scope["path"])]
        response = await endpoint(Request(scope, receive))
        await response(scope, receive, send)
    return app


def fastapi_app():
    from fastapi import FastAPI
    from fastapi.responses import Response
    from pydantic import BaseModel

    class EmbeddingRequest(BaseModel):
        input: str | list[str]
        model: str = ""

    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest) -> Response:
        return Response(_answer(request.model_dump()), media_type="application/json")

    return app


async def serve(stack: str, port: int) -> None:
    """Serve `stack` on 127.0.0.1:`port` in the running loop until killed."""
    if stack == "starlette+granian-embedded":
        from granian.constants import Interfaces
        from granian.server.embed import Server as Granian

        await Granian(starlette_app(), address="127.0.0.1", port=port, interface=Interfaces.ASGINL,
                      log_enabled=False).serve()
        return
    import uvicorn

    app = {"raw-asgi": raw_app, "starlette": starlette_app, "starlette-direct": starlette_direct_app,
           "fastapi": fastapi_app}[stack.split("+")[0]]()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="h11" if stack.endswith("h11") else "httptools",
                            lifespan="off", ws="none", access_log=False, log_config=None,
                            proxy_headers=False, log_level="warning")
    await uvicorn.Server(config).serve()


def _wait_up(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/v1/embeddings", body=b'{"input":"x","model":"m"}',
                         headers={"Content-Type": "application/json"})
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure(port: int, requests: int, warmup: int) -> list[float]:
    """Milliseconds per request over one keep-alive connection, each with a new text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times = []
    for i in range(warmup + requests):
        body = json.dumps({"input": f"query number {i} about embedding servers", "model": "m"}).encode()
        start = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200 or b"embedding" not in data:
            raise RuntimeError(f"bad answer {response.status}: {data[:200]!r}")
        if i >= warmup:
            times.append(elapsed * 1e3)
    conn.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per stack per round")
    parser.add_argument("--warmup", type=int, default=200, help="untimed requests before each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ", ".join(STACKS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(serve(args.serve, args.port))
        return 0
    stacks = [s for s in args.stacks.split(",") if s]
    servers = {}
    try:
        for stack in stacks:
            port = free_port()
            servers[stack] = (port, subprocess.Popen(
                [sys.executable, "-m", "benchmarks.http_stacks", "--serve", stack, "--port", str(port)],
                env=dict(os.environ, PYTHONUNBUFFERED="1")))
        for port, _ in servers.values():
            _wait_up(port)
        times: dict[str, list[float]] = {s: [] for s in stacks}
        for _ in range(args.rounds):
            for stack in stacks:
                times[stack] += measure(servers[stack][0], args.requests, args.warmup)
    finally:
        for _, process in servers.values():
            process.terminate()
            process.wait(10)
    results = {s: {"p50_ms": round(float(np.percentile(t, 50)), 4), "p99_ms": round(float(np.percentile(t, 99)), 4),
                   "mean_ms": round(float(np.mean(t)), 4), "requests": len(t)} for s, t in times.items()}
    for stack, r in results.items():
        print(f"{stack:32s} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
    if args.out is not None:
        import granian
        import starlette
        import uvicorn
        import fastapi

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "-m", "benchmarks.http_stacks", *(argv or sys.argv[1:])]),
            "what": "batch-1 round trip of an embed-shaped handler (no model), http.client keep-alive client, uvloop",
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": {"uvicorn": uvicorn.__version__, "starlette": starlette.__version__,
                         "fastapi": fastapi.__version__, "granian": granian.__version__},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
