"""Qdrant ingest throughput (local :memory: mode) as a share of the raw engine's throughput on the same texts.

Three measurements on one corpus of synthetic passages, alternated over a few rounds
(best of each kept, since load from other processes only ever slows a run down):

1. engine: the texts tokenized by the sidecar's own tokenizer (not timed), then
   `Engine.embed` in-process on steps packed to the sidecar's CPU/GPU step budget
   (SchedulerConfig.for_device(...).max_step_tokens) - the ceiling for anything
   that goes through the sidecar;
2. stream: the same texts through `fern serve` (a subprocess) with
   FernClient.embed_stream, vectors received and dropped - what the gRPC sidecar adds;
3. ingest: FernQdrantClient(":memory:").ingest(...) - dense + sparse vectors upserted
   into local-mode Qdrant, and the same with the dense vector only.

Usage: python -m benchmarks.qdrant_ingest [--texts 2000] [--rounds 3] [--device cpu] [--out FILE]
(--target HOST:PORT uses a running sidecar instead of starting one).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.pg_common import (EngineRun, best_of_rounds, measure_stream, passages,
                                  warm_sidecar, write_result)

WORDS = ("engine vector search query index token batch model latency throughput database "
         "sidecar stream shard replica cluster memory graph kernel tensor embedding cosine "
         "distance filter payload collection point sparse dense hybrid fusion rank score "
         "river mountain garden kitchen market harbor forest desert island village bridge "
         "music painting theatre novel poem festival museum library garden station").split()
_SERVING = re.compile(r"^fern: serving .* on (\S+) \(")


def corpus(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """`n` deterministic passages of 20-60 words, with an id and a title."""
    return [{"id": i, "title": f"Passage {i}", "text": text}
            for i, text in enumerate(passages(n, seed, WORDS))]


def measure_ingest(target: str, rows: list[dict[str, Any]], batch_size: int, in_flight: int,
                   sparse: bool) -> dict[str, Any]:
    from adapters.qdrant.client import FernQdrantClient

    client = FernQdrantClient(":memory:", fern=target)
    client.setup_collection("bench", sparse="sparse" if sparse else None)
    summary = client.ingest("bench", rows, text="text", id="id", batch_size=batch_size,
                            max_in_flight=in_flight, progress=False)
    count = client.count("bench").count
    client.close()
    if count != len(rows):
        raise RuntimeError(f"ingest stored {count} points for {len(rows)} rows")
    return {"rows_per_s": summary.rows_per_second, "seconds": summary.seconds,
            "requests": summary.requests}


def start_sidecar(device: str, threads: int) -> tuple[subprocess.Popen, str]:
    """`fern serve` on a free loopback port; returns the process and its target."""
    log = tempfile.NamedTemporaryFile("w+", prefix="fern-bench-", suffix=".log", delete=False)
    fern = Path(sys.executable).with_name("fern")
    cmd = [str(fern) if fern.exists() else "fern", "serve", "--host", "127.0.0.1", "--port", "0",
           "--device", device]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the sidecar's torch threads
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`fern serve` exited with {proc.returncode}:\n"
                               f"{Path(log.name).read_text()}")
        for line in Path(log.name).read_text().splitlines():
            if m := _SERVING.match(line):
                return proc, m.group(1)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("`fern serve` did not come up in 180 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=2000, help="passages in the corpus")
    parser.add_argument("--device", default="cpu", help="engine device (cpu, cuda, auto)")
    parser.add_argument("--batch-size", type=int, default=64, help="records per ingest request")
    parser.add_argument("--in-flight", type=int, default=8, help="ingest requests in flight")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads, in-process engine and sidecar alike (default: cores)")
    parser.add_argument("--target", default=None, help="use a running sidecar at HOST:PORT")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/qdrant_ingest.json"))
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds through the finally below, which stops the sidecar.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from importlib.metadata import version

    load_at_start = os.getloadavg()
    rows = corpus(args.texts)
    texts = [r["text"] for r in rows]
    proc = None
    target = args.target
    if target is None:
        proc, target = start_sidecar(args.device, args.threads)
    runs: dict[str, list[dict[str, Any]]] = {"engine": [], "sidecar_stream": [],
                                             "ingest_hybrid": [], "ingest_dense_only": []}
    try:
        import torch

        warm_sidecar(target, texts)
        torch.set_num_threads(args.threads)
        engine = EngineRun(texts, args.device)
        # Rounds alternate the measurements, and the best of each is kept: on a shared
        # machine, other load only ever slows a run down. The idle sidecar costs the
        # in-process engine nothing.
        for _ in range(args.rounds):
            runs["engine"].append(engine.measure())
            runs["sidecar_stream"].append(measure_stream(target, texts, args.batch_size,
                                                         sparse=True))
            runs["ingest_hybrid"].append(
                measure_ingest(target, rows, args.batch_size, args.in_flight, sparse=True))
            runs["ingest_dense_only"].append(
                measure_ingest(target, rows, args.batch_size, args.in_flight, sparse=False))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    best = best_of_rounds(runs)
    engine_rps = best["engine"]["rows_per_s"]
    stream_rps = best["sidecar_stream"]["rows_per_s"]
    result = {
        "qdrant_client": version("qdrant-client"),
        "qdrant_mode": "local :memory:",
        "texts": args.texts,
        "batch_size": args.batch_size,
        "max_in_flight": args.in_flight,
        "rounds": args.rounds,
        "torch_threads": args.threads,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "best": best,
        "all_rows_per_s": {name: [round(r["rows_per_s"], 1) for r in values]
                           for name, values in runs.items()},
        "share_of_engine": {name: best[name]["rows_per_s"] / engine_rps
                            for name in ("ingest_hybrid", "ingest_dense_only", "sidecar_stream")},
        "share_of_sidecar_stream": {name: best[name]["rows_per_s"] / stream_rps
                                    for name in ("ingest_hybrid", "ingest_dense_only")},
        "goal": "ingest_hybrid >= 0.80 of engine",
    }
    write_result("qdrant_ingest", argv, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
