"""One client process of the suite's end-to-end latency: sequential batch-1 `FernClient.embed` calls.

`python -m benchmarks.latency_client TARGET --iters N --warmup W < texts.json` (TARGET is
host:port, or unix:/path for a sidecar's --uds socket) reads a JSON
list of texts, embeds them one per call in turn (W untimed calls on the first W texts, then
the timed calls on the texts after them, so that with W + N texts no timed call repeats a
text) and prints one JSON line: the percentiles in milliseconds. The suite runs it as a subprocess, since a
user's client is a process of its own (not the benchmark's, which holds torch, a CUDA
context and threads), and once per gRPC client setting, which gRPC reads only at start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency_client", description=__doc__.splitlines()[0])
    p.add_argument("target", help="the sidecar: host:port, or unix:/path for its --uds socket")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args(argv)
    texts = json.load(sys.stdin)

    from benchmarks.stats import percentiles
    from sidecar.client import FernClient

    with FernClient(args.target) as client:
        for i in range(args.warmup):
            client.embed([texts[i % len(texts)]])
        samples = []
        for i in range(args.warmup, args.warmup + args.iters):
            start = time.perf_counter()
            client.embed([texts[i % len(texts)]])
            samples.append((time.perf_counter() - start) * 1e3)
    print(json.dumps(percentiles(samples)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
