"""How long a full garbage collection stalls the sidecar process, with and without `fern serve`'s freeze.

CPython's collector walks every tracked object in a full (oldest-generation) collection,
and it does so on whichever thread allocated last: in the sidecar, usually the event loop,
so every request in flight waits. `fern serve` collects once after loading the models and
freezes what is left (`sidecar.serve.settle_heap`); this measures what that buys.

In one process, loaded as `fern serve` loads (the bundled model unless --model says
otherwise): the tracked objects and the wall time of `gc.collect()` (median of --repeats)
before the freeze; after it; and after --queries queries through the gateway (the state a
serving process reaches: tokenizer memo, scheduler and gRPC-side objects created since).

Usage: python -m tools.profiling.gc_pause [--model DIR] [--device cpu] [--queries 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import result_header


def _collect_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


async def _queries(registry, count: int) -> None:
    from sidecar.gateway import EmbedParams, Gateway

    await registry.start()
    gateway = Gateway(registry)
    words = "the quick brown fox jumps over the lazy dog near a river bank while it rains".split()
    for i in range(count):
        text = " ".join(words[(i + k) % len(words)] for k in range(8 + i % 24)) + f" {i}"
        await gateway.embed(EmbedParams(texts=[text]))
    await registry.drain()


def run(model: str | None, device: str, queries: int, repeats: int) -> dict[str, Any]:
    from sidecar.serve import settle_heap
    from core_engine.settings import SidecarConfig
    from sidecar.registry import ModelSource, Registry

    registry = Registry.load([ModelSource(Path(model) if model else None)], device=device,
                             settings=SidecarConfig.from_env())
    rows: dict[str, Any] = {}
    rows["loaded"] = {"tracked_objects": len(gc.get_objects()), "full_collect_ms": _collect_ms(repeats)}
    frozen = settle_heap()
    rows["frozen"] = {"frozen_objects": frozen, "tracked_objects": len(gc.get_objects()),
                      "full_collect_ms": _collect_ms(repeats)}
    asyncio.run(_queries(registry, queries))
    rows[f"after_{queries}_queries"] = {"tracked_objects": len(gc.get_objects()),
                                        "full_collect_ms": _collect_ms(repeats)}
    registry.close()
    for name, row in rows.items():
        print(name, row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = {**result_header("tools.profiling.gc_pause", argv), "python": sys.version.split()[0],
              "gc": run(args.model, args.device, args.queries, args.repeats)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
