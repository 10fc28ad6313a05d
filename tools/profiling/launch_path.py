"""Where the host time of one small online step goes: prepare, the replay decision, the launch, the copy back.

An ONLINE query that finds the GPU idle is prepared and launched on the event loop
(sidecar/scheduler/launch.py): `engine.prepare`, `engine.replays`, `engine.step`, then the loop
polls `handle.done()` and takes `handle.result()`. Through the server, the stage trace
(`benchmarks.lanes_e2e --trace`) sees that path as one "queued" stage, admitted to launched.
This runs the same calls in one process on the served engine (compiled, the step's graph
captured), one query after another, and times each piece by wrapping the engine's own methods,
so a piece's time includes the pieces it calls (`step` includes `graphs.run`, and so on).
`gpu` is the step's device time (CUDA events around it); `host_total` is prepare to
launched, the host work the loop does before the GPU starts.

Usage: python -m tools.profiling.launch_path --model DIR [--tokens 20] [--iters 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.provenance import result_header


def _wrap(owner: Any, name: str, label: str, times: dict[str, list[int]]) -> Callable[[], None]:
    """Time every call of `owner.name` into times[label]; returns the undo."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        started = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter_ns() - started)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _summary(values: list[int], steps: int | None) -> dict[str, float | None]:
    """Percentiles in µs of `values` (ns), and how many there were per step (None: not per step)."""
    us = np.asarray(values, dtype=np.float64) / 1e3
    return {"p50_us": round(float(np.percentile(us, 50)), 1), "p90_us": round(float(np.percentile(us, 90)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1),
            "calls_per_step": round(len(values) / steps, 2) if steps else None}


def run(model: str, device: str, tokens: int, iters: int) -> dict[str, Any]:
    import torch

    import core_engine.engine as engine_module
    from core_engine.attention.select import AttentionSelector
    from core_engine.engine import Engine
    from core_engine.graphs import GraphCache
    from core_engine.handle import EmbeddingHandle

    engine = Engine(model, device=device)
    rng = np.random.default_rng(0)
    vocab = engine.spec.vocab_size
    queries = [[101, *rng.integers(1000, min(vocab, 30000), tokens - 2).tolist(), 102] for _ in range(iters + 200)]
    for ids in queries[:200]:  # the shape's eager run, its capture, and warm replays
        engine.step(engine.prepare([ids])).result()

    times: dict[str, list[int]] = defaultdict(list)
    undo = [
        _wrap(Engine, "prepare", "prepare", times), _wrap(Engine, "_pack", "prepare: pack", times),
        _wrap(engine_module, "pack_into", "prepare: pack: pack_into", times),
        _wrap(Engine, "_plan", "plan (prepare and launch)", times), _wrap(AttentionSelector, "plan", "attention.plan", times),
        _wrap(Engine, "replays", "replays", times), _wrap(Engine, "step", "step", times),
        _wrap(Engine, "_action", "action (replays and launch)", times),
        _wrap(AttentionSelector, "use", "launch: attention.use", times),
        _wrap(GraphCache, "run", "launch: graphs.run", times),
        _wrap(EmbeddingHandle, "from_device", "launch: handle.from_device", times),
    ]
    host_total, gpu, wait, result_us, polls = [], [], [], [], []
    cuda = engine.device.type == "cuda"
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    try:
        for ids in queries[200:]:
            t0 = time.perf_counter_ns()
            batch = engine.prepare([ids])
            engine.replays(batch)
            if cuda:
                start.record()
            handle = engine.step(batch)
            if cuda:
                end.record()
            t1 = time.perf_counter_ns()
            n = 0
            while not handle.done():
                n += 1
            t2 = time.perf_counter_ns()
            handle.result()
            t3 = time.perf_counter_ns()
            host_total.append(t1 - t0)
            wait.append(t2 - t1)
            result_us.append(t3 - t2)
            polls.append(n)
            if cuda:
                gpu.append(int(start.elapsed_time(end) * 1e6))
    finally:
        for u in undo:
            u()
    pinned = []
    for _ in range(1000 if cuda else 0):
        t = time.perf_counter_ns()
        torch.empty(64, dtype=torch.int64, pin_memory=True)
        pinned.append(time.perf_counter_ns() - t)
    pieces = {label: _summary(values, iters) for label, values in times.items()}
    pieces["host_total (prepare to launched)"] = _summary(host_total, iters)
    if cuda:
        pieces["gpu (step, CUDA events)"] = _summary(gpu, iters)
    pieces["wait (launched to done)"] = _summary(wait, iters)
    pieces["result()"] = _summary(result_us, iters)
    if cuda:
        pieces["torch.empty(64, pin_memory=True)"] = _summary(pinned, None)
    return {"tokens": tokens, "iters": iters, "polls_per_step_p50": float(np.median(polls)),
            "counters": str(engine.counters), "compiled": engine.compiled, "pieces_us": pieces}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (the served checkpoint)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=20, help="tokens in each query, special tokens included")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = {**result_header("tools.profiling.launch_path", argv),
              "launch_path": run(args.model, args.device, args.tokens, args.iters)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
