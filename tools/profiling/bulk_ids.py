"""What a bulk request's ids cost the server once a tokenizer worker process has made them.

A worker sends a slice's ids back as int32 bytes (`sidecar.tokenize.pool._packed_ids`). In the
server those bytes are unpacked (`_unpacked`) and packed into a step's int64 buffer
(`core_engine.batch.pack_into`, the whole-array way a bulk step takes), on the event loop and
the engine's thread, where queries wait for the same GIL. This times both, per request of
--texts passages of --low..--high tokens, two ways: the ids as int32 views of the worker's
bytes (what the server does for the model's ids) and as Python int lists (what it does for
sparse-vector ids). Medians of --repeats, rounds interleaved.

Usage: python -m tools.profiling.bulk_ids [--model DIR] [--texts 256] [--low 64] [--high 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import result_header
from benchmarks.texts import make_texts
from core_engine.batch import pack_into, packed_size
from core_engine.graphs import GraphKey
from sidecar.tokenize.pool import _WORKER, WorkerModel, _packed_ids, _unpacked


def _timed(packed: memoryview, how: str, key: GraphKey, ramp: np.ndarray) -> tuple[float, float]:
    """Milliseconds to unpack `packed` as `how` gives it, and to pack those ids into a step's buffer."""
    buf = np.empty(packed_size(key.tokens, key.slots), dtype=np.int64)
    started = time.perf_counter()
    seqs = _unpacked(packed, how)
    unpacked = time.perf_counter()
    pack_into(buf, key, seqs, [len(s) for s in seqs], key.tokens, ramp, sliced=False)
    done = time.perf_counter()
    return (unpacked - started) * 1e3, (done - unpacked) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    from core_engine.loader import default_model_dir

    tokenizer = (Path(args.model) if args.model else default_model_dir()) / "tokenizer.json"
    rng = np.random.default_rng(26)
    texts = make_texts(tokenizer, rng.integers(args.low, args.high + 1, size=args.texts).tolist(), seed=26)
    model = WorkerModel(str(tokenizer), max_tokens=512, eos_id=None)
    _WORKER.start(1, (model,))  # this process plays the worker: the same bytes a worker sends
    packed = memoryview(_packed_ids(model, texts, "truncate")).toreadonly()[1:]  # less its OK byte
    lengths = np.array([len(ids) for ids in _unpacked(packed, "truncate")])
    key = GraphKey(int(lengths.sum()), len(lengths), int(lengths.max()))
    ramp = np.arange(key.tokens, dtype=np.int64)
    ways = {"int32_views": "truncate", "int_lists": "plain"}  # "plain" only picks lists here
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, how in ways.items():
            times[name].append(_timed(packed, how, key, ramp))
    rows = {}
    for name, runs in times.items():
        unpack, pack = (statistics.median(t[i] for t in runs) for i in (0, 1))
        rows[name] = {"unpack_ms": round(unpack, 3), "pack_ms": round(pack, 3), "total_ms": round(unpack + pack, 3)}
    return {"workload": {"texts": args.texts, "tokens": key.tokens, "low": args.low, "high": args.high,
                         "repeats": args.repeats, "tokenizer": str(tokenizer)},
            "per_request": rows,
            "lists_over_views": round(rows["int_lists"]["total_ms"] / rows["int32_views"]["total_ms"], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled MiniLM)")
    parser.add_argument("--texts", type=int, default=256, help="passages per request")
    parser.add_argument("--low", type=int, default=64)
    parser.add_argument("--high", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {**result_header("tools.profiling.bulk_ids", argv), **run(args)}
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
