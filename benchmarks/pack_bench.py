"""Host cost of `Engine.prepare`: packing token ids into one step's buffer, per batch shape, CPU only.

Every online request pays `prepare` on its way to the GPU (on the event loop, when it launches
its own step), so its per-call overhead is a share of a query's latency. For each shape
(sequences x tokens each; MiniLM takes up to 256) this times, in microseconds per call (median of `--rounds` rounds):

- `prepare`: the whole of `Engine.prepare` on the bundled MiniLM engine on the CPU with bucket
  padding on, as on CUDA (packing, graph key, attention plan; the CPU buffer is not pinned);
- `sliced`, `whole_array`: the two ways `pack_into` fills the buffer (one slice assignment per
  sequence and region, or numpy's whole-array operations), on the same inputs; the engine
  picks sliced up to SLICED_PACK_SEQS sequences.

Usage: python -m benchmarks.pack_bench [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.provenance import result_header

SHAPES = ((1, 16), (1, 128), (1, 256), (2, 128), (4, 128), (8, 128), (16, 128), (32, 256), (100, 256))


def _per_call_us(fn: Callable[[], Any], budget_s: float = 0.2) -> float:
    calls = 0
    started = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= budget_s and calls >= 20:
            return elapsed / calls * 1e6


def run(rounds: int) -> dict[str, Any]:
    from core_engine.batch import SLICED_PACK_SEQS, pack_into, packed_size
    from core_engine.engine import Engine

    engine = Engine(device="cpu", pad_to_buckets=True)
    rng = np.random.default_rng(0)
    rows = {}
    for count, length in SHAPES:
        seqs = [rng.integers(1000, 20000, size=length).tolist() for _ in range(count)]
        lengths = [len(s) for s in seqs]
        total = sum(lengths)
        key = engine.prepare(seqs).key
        buf = np.empty(packed_size(key.tokens, key.slots), dtype=np.int64)
        ramp = engine._ramp
        ways = {"prepare": lambda: engine.prepare(seqs),
                "sliced": lambda: pack_into(buf, key, seqs, lengths, total, ramp, sliced=True),
                "whole_array": lambda: pack_into(buf, key, seqs, lengths, total, ramp, sliced=False)}
        timings: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, fn in ways.items():
                timings[name].append(_per_call_us(fn))
        rows[f"{count}x{length}"] = {name: round(statistics.median(v), 2) for name, v in timings.items()}
        print(f"{count:4d} x {length:4d}", rows[f"{count}x{length}"], flush=True)
    return {"sliced_pack_seqs": SLICED_PACK_SEQS, "us_per_call": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = {**result_header("benchmarks.pack_bench", argv), **run(args.rounds)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
