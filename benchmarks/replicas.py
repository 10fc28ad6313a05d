"""Bulk throughput through one client channel over one sidecar and over several, on loopback.

`python -m benchmarks.replicas [--sidecars 1 2] [--clients 4] [--requests 60] [--batch 32]
[--tokens 48] [--out FILE]` starts N `fern serve` processes (CPU, the bundled model, the
machine's cores split between them), points every client at all of them as one comma-list
target (gRPC's round_robin), sends BATCH-lane Embed calls, and reads each sidecar's
/metrics for how many requests it completed. The point is the spread: whether the client
keeps every sidecar busy, not the CPU's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.provenance import result_header
from benchmarks.server import free_port, start_sidecar
from benchmarks.texts import make_texts


def _completed(metrics_port: int) -> int:
    """fern_requests_completed_total over both lanes, from one sidecar's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "fern_requests_completed" for sample in family.samples
                   if sample.name.endswith("_total")))


def run(sidecars: int, args: argparse.Namespace, texts: list[str], log_dir: Path) -> dict:
    from sidecar.client import FernClient

    threads = max(1, (os.cpu_count() or 1) // sidecars)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    started, ports = [], []
    try:
        for index in range(sidecars):
            port = free_port()
            started.append(start_sidecar(None, device="cpu", log_dir=log_dir, name=f"{sidecars}-{index}",
                                         extra=["--metrics-port", str(port)]))
            ports.append(port)
        target = ",".join(s.target for s in started)
        failures: list[BaseException] = []

        def client_loop(seed: int) -> None:
            with FernClient(target, timeout=300) as client:
                for i in range(args.requests):
                    start = (seed * args.requests + i) * args.batch % (len(texts) - args.batch)
                    try:
                        client.embed(texts[start:start + args.batch], lane="batch")
                    except BaseException as error:  # counted: a failed call is a result here
                        failures.append(error)

        with FernClient(target) as warm:
            for _ in range(2 * sidecars):
                warm.embed(texts[:args.batch], lane="batch")
        before = [_completed(p) for p in ports]
        workers = [threading.Thread(target=client_loop, args=(c,)) for c in range(args.clients)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        per_sidecar = [_completed(p) - b for p, b in zip(ports, before)]
    finally:
        for s in started:
            s.stop()
    calls = args.clients * args.requests
    return {"sidecars": sidecars, "torch_threads_each": threads, "calls": calls,
            "failed_calls": len(failures), "seconds": round(seconds, 3),
            "embeddings_per_s": round(calls * args.batch / seconds, 1),
            "requests_per_sidecar": per_sidecar,
            "spread_max_over_min": round(max(per_sidecar) / max(min(per_sidecar), 1), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__.splitlines()[0])
    p.add_argument("--sidecars", type=int, nargs="+", default=[1, 2])
    p.add_argument("--clients", type=int, default=4, help="client threads, each with its own channel")
    p.add_argument("--requests", type=int, default=60, help="Embed calls per client")
    p.add_argument("--batch", type=int, default=32, help="texts per call")
    p.add_argument("--tokens", type=int, default=48, help="tokens per text")
    p.add_argument("--out", default="benchmarks/results/cpu/replicas.json")
    args = p.parse_args(argv)
    from core_engine.loader import default_model_dir

    texts = make_texts(default_model_dir() / "tokenizer.json", [args.tokens] * 4096, seed=3)
    log_dir = Path(tempfile.mkdtemp(prefix="fern-replicas-"))
    runs = [run(n, args, texts, log_dir) for n in args.sidecars]
    result = {**result_header("benchmarks.replicas", argv),
              "what": "bulk Embed calls (BATCH lane) through one comma-list channel per client over N "
                      "sidecars on loopback; requests_per_sidecar from each sidecar's /metrics",
              "clients": args.clients, "batch": args.batch, "tokens_per_text": args.tokens, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    json.dump(runs, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
