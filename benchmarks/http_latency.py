"""Batch-1 latency and bulk throughput over the HTTP door beside gRPC, against one `fern serve` in the same run.

Latency: one text per call, a new text each call, gRPC (FernClient) and HTTP (OpenAI's
`POST /v1/embeddings`, base64 as the OpenAI SDK asks, over one keep-alive `http.client`
connection, the response decoded to numpy) alternating call by call, so that both see the
same machine. Throughput: `--clients` threads each sending requests of `--throughput-texts`
texts of `--throughput-tokens` tokens on the BATCH lane, a warm round then a timed one, gRPC
then HTTP.

    python -m benchmarks.http_latency --device cpu --iters 100 --out benchmarks/results/cpu/http.json
    python -m benchmarks.http_latency --device cuda --model /models/bge-m3 --tokens 128 --iters 2000 \\
        --out benchmarks/results/h200/http.json
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.provenance import result_header
from benchmarks.server import free_port, start_sidecar
from benchmarks.stats import percentiles
from benchmarks.texts import make_texts


def _tokenizer_path(model: str | None) -> Path:
    if model is None:
        from core_engine.loader import default_model_dir

        return default_model_dir() / "tokenizer.json"
    return Path(model.partition("=")[2] or model) / "tokenizer.json"


class HttpEmbedder:
    """OpenAI-API calls on one keep-alive connection (http.client: the least a Python client adds)."""

    def __init__(self, port: int, model: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.model = model

    def embed(self, texts: list[str], lane: str = "online") -> np.ndarray:
        body = json.dumps({"input": texts, "model": self.model, "encoding_format": "base64", "lane": lane})
        self.conn.request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {payload[:300]!r}")
        data = json.loads(payload)["data"]
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])

    def close(self) -> None:
        self.conn.close()


def _wait_http(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the HTTP door on port {port} did not answer /health in {timeout:.0f} s")
        time.sleep(0.1)


def latency(grpc_embed: Callable[[list[str]], np.ndarray], http_embed: Callable[[list[str]], np.ndarray],
            texts: list[str], warmup: int, iters: int) -> dict:
    """Alternating batch-1 calls; texts[2i] goes over gRPC and texts[2i + 1] over HTTP."""
    samples: dict[str, list[float]] = {"grpc": [], "http": []}
    for i in range(warmup + iters):
        for name, embed, text in (("grpc", grpc_embed, texts[2 * i]), ("http", http_embed, texts[2 * i + 1])):
            start = time.perf_counter()
            embed([text])
            elapsed = (time.perf_counter() - start) * 1e3
            if i >= warmup:
                samples[name].append(elapsed)
    out = {name: percentiles(s, digits=4) for name, s in samples.items()}
    out["http_minus_grpc_p50_ms"] = round(out["http"]["p50_ms"] - out["grpc"]["p50_ms"], 4)
    out["http_minus_grpc_p99_ms"] = round(out["http"]["p99_ms"] - out["grpc"]["p99_ms"], 4)
    return out


def throughput(make_client: Callable[[], object], requests: list[list[str]], clients: int, seconds: float) -> dict:
    """Embeddings/s from `clients` threads in steady state (a first round of `seconds` is not counted)."""

    def load(duration: float) -> tuple[int, float, list[float]]:
        counts = [0] * clients
        latencies: list[float] = []
        stop = threading.Event()

        def loop(slot: int) -> None:
            client = make_client()
            try:
                k = slot
                while not stop.is_set():
                    start = time.perf_counter()
                    vectors = client.embed(requests[k % len(requests)], lane="batch")
                    latencies.append((time.perf_counter() - start) * 1e3)
                    counts[slot] += len(vectors)
                    k += 1
            finally:
                client.close()

        threads = [threading.Thread(target=loop, args=(s,)) for s in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(duration)
        stop.set()
        for t in threads:
            t.join()
        return sum(counts), time.perf_counter() - start, latencies

    load(seconds)
    done, elapsed, latencies = load(seconds * 2)
    return {"embeddings_per_s": round(done / elapsed, 2), "embeddings": done, "seconds": round(elapsed, 2),
            "request_latency": percentiles(latencies, digits=2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http_latency", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="fern serve --device (cpu, cuda, cuda:N)")
    p.add_argument("--model", default=None, help="fern serve --model DIR (default: the bundled MiniLM)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per latency text (with specials)")
    p.add_argument("--iters", type=int, default=200, help="timed batch-1 calls per protocol")
    p.add_argument("--warmup", type=int, default=50, help="untimed batch-1 calls per protocol first")
    p.add_argument("--throughput-texts", type=int, default=100, help="texts per throughput request")
    p.add_argument("--throughput-tokens", type=int, default=512, help="tokens per throughput text")
    p.add_argument("--throughput-seconds", type=float, default=5.0, help="warm round length; the timed one is 2x")
    p.add_argument("--clients", type=int, default=4, help="concurrent throughput clients per protocol")
    p.add_argument("--serve-arg", action="append", default=[], help="more `fern serve` flags (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from sidecar.client import FernClient

    tokenizer = _tokenizer_path(args.model)
    texts = make_texts(tokenizer, [args.tokens] * (2 * (args.warmup + args.iters)), seed=21)
    bulk = make_texts(tokenizer, [args.throughput_tokens] * (4 * args.throughput_texts), seed=22)
    requests = [bulk[k * args.throughput_texts:(k + 1) * args.throughput_texts] for k in range(4)]
    http_port = free_port()
    extra = ["--http-port", str(http_port), *(a for arg in args.serve_arg for a in arg.split())]
    served = start_sidecar(Path(args.model) if args.model else None, device=args.device, extra=extra,
                           log_dir=Path(tempfile.mkdtemp(prefix="fern-http-bench-")), name="http")
    try:
        _wait_http(http_port)
        with FernClient(served.target, timeout=300) as grpc_client:
            model = grpc_client.model().name
            http_client = HttpEmbedder(http_port, model)
            try:
                check_grpc = grpc_client.embed(texts[:2]).vectors
                check_http = http_client.embed(texts[:2])
                agreement = float(np.min((check_grpc * check_http).sum(1) / np.linalg.norm(check_grpc, axis=1)
                                         / np.linalg.norm(check_http, axis=1)))
                lat = latency(lambda t: grpc_client.embed(t).vectors, http_client.embed, texts, args.warmup,
                              args.iters)
            finally:
                http_client.close()

        class Grpc:  # a FernClient per thread, shaped like HttpEmbedder
            def __init__(self) -> None:
                self.client = FernClient(served.target, timeout=300)

            def embed(self, batch: list[str], lane: str) -> np.ndarray:
                return self.client.embed(batch, lane=lane).vectors

            def close(self) -> None:
                self.client.close()

        grpc_tp = throughput(Grpc, requests, args.clients, args.throughput_seconds)
        http_tp = throughput(lambda: HttpEmbedder(http_port, model), requests, args.clients, args.throughput_seconds)
    finally:
        served.stop()
    result = {
        **result_header("benchmarks.http_latency", argv),
        "server_command": " ".join(served.command),
        "model": model, "device": args.device,
        "http_client": "http.client, one keep-alive connection per client, OpenAI API, encoding_format base64",
        "grpc_client": "sidecar.client.FernClient",
        "cosine_http_vs_grpc_min": round(agreement, 7),
        "latency": {"tokens_per_text": args.tokens, "warmup": args.warmup, "iters": args.iters, **lat},
        "throughput": {"texts_per_request": args.throughput_texts, "tokens_per_text": args.throughput_tokens,
                       "clients": args.clients, "lane": "batch", "grpc": grpc_tp, "http": http_tp,
                       "http_over_grpc": round(http_tp["embeddings_per_s"] / grpc_tp["embeddings_per_s"], 4)},
    }
    text = json.dumps(result, indent=2) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
