"""Backfill throughput of the PostgreSQL adapter as a share of the raw engine's on the same texts.

Three measurements on one corpus of synthetic passages, alternated over a few rounds
(best of each kept: load from other processes only ever slows a run down):

1. engine: the texts tokenized by the sidecar's tokenizer (untimed), then `Engine.embed`
   in-process on steps packed to the sidecar's step budget: the ceiling;
2. stream: the same texts through `fern serve` with FernClient.embed_stream in batches
   of the worker's size, vectors dropped: what the sidecar and gRPC leave of it;
3. backfill: a table of the texts in an embedded PostgreSQL 18; `create_vectorizer`
   (adds the column + HNSW index, enqueues every row) while a `fern pg worker` process
   LISTENs, timed until the queue is empty and every row has its vector.

On a GPU host the engine is far from the CPU; on a 2-core CPU the sidecar, the worker
and PostgreSQL share the two cores with the engine's forward passes, so the share there
is a floor. Usage: python -m benchmarks.pg_backfill [--texts 3000] [--rounds 3]
[--device cpu] [--batch-size 128] [--threads 1] [--target HOST:PORT]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.pg_common import (EngineRun, best_of_rounds, measure_stream, passages,
                                  running_worker, start_sidecar, warm_sidecar, write_result)

WORDS = ("engine vector search query index token batch model latency throughput database "
         "river mountain garden kitchen market harbor forest desert island village bridge "
         "music painting theatre novel poem festival museum library station weather "
         "customer invoice shipment warehouse contract meeting schedule report budget").split()
# The engine fields this benchmark's result files have always recorded.
ENGINE_FIELDS = ("rows_per_s", "seconds", "tokens", "step_tokens", "device")


def corpus(n: int, seed: int = 11) -> list[str]:
    """`n` deterministic passages of 20-60 words."""
    return passages(n, seed, WORDS)


def measure_backfill(dsn: str, target: str, texts: list[str], round_no: int) -> dict[str, Any]:
    import psycopg

    from adapters.postgres.vectorizer import create_vectorizer, drop_vectorizer
    from sidecar.client import FernClient

    table = f"passages_{round_no}"
    with psycopg.connect(dsn, autocommit=True) as conn, FernClient(target) as fern:
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {table} VALUES (%s, %s)", list(enumerate(texts)))
        start = time.perf_counter()
        create_vectorizer(conn, table, ["body"], client=fern)
        while conn.execute("SELECT EXISTS (SELECT 1 FROM fern.queue)").fetchone()[0]:
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        done = conn.execute(f"SELECT count(embedding) FROM {table}").fetchone()[0]
        if done != len(texts):
            raise RuntimeError(f"backfill left {len(texts) - done} rows without a vector")
        drop_vectorizer(conn, table)
        conn.execute(f"DROP TABLE {table}")
    return {"rows_per_s": len(texts) / seconds, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=128, help="the worker's rows per request")
    parser.add_argument("--target", default=None, help="use a running sidecar at HOST:PORT")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, for the in-process engine and the sidecar "
                             "alike (0: torch's default). On a shared 2-core box 2 threads make "
                             "both swing 10x with other load; 1 keeps the comparison fair")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/pg_backfill.json"))
    args = parser.parse_args(argv)
    if args.threads:
        import os

        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the sidecar subprocess's torch

    from adapters.postgres.embedded import EmbeddedPostgres
    from adapters.postgres.installer import install

    texts = corpus(args.texts)
    side = None if args.target else start_sidecar(args.device)
    target = args.target or side.target
    runs: dict[str, list[dict[str, Any]]] = {"engine": [], "sidecar_stream": [], "backfill": []}
    try:
        import psycopg

        warm_sidecar(target, texts)
        engine = EngineRun(texts, args.device)
        with EmbeddedPostgres() as pg:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                install(conn)
            with running_worker(pg.dsn, target, args.batch_size):
                for n in range(args.rounds):
                    timing = engine.measure()
                    runs["engine"].append({k: timing[k] for k in ENGINE_FIELDS})
                    runs["sidecar_stream"].append(measure_stream(target, texts, args.batch_size,
                                                                 prompt="passage"))
                    runs["backfill"].append(measure_backfill(pg.dsn, target, texts, n))
    finally:
        if side is not None:
            side.stop()
    best = best_of_rounds(runs)
    engine_rps = best["engine"]["rows_per_s"]
    result = {
        "what": "rows/s: raw engine (in-process, untimed tokenization) vs sidecar stream vs "
                "create_vectorizer backfill through fern pg worker, best of the rounds",
        "setup": {"texts": args.texts, "rounds": args.rounds, "device": args.device,
                  "torch_threads": args.threads or "default",
                  "worker_batch_size": args.batch_size, "words_per_text": "20-60",
                  "postgres": "embedded 18 + pgvector (fsync off), HNSW index built as rows land"},
        "best": {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                 for k, v in best.items()},
        "rounds": runs,
        "share_of_engine_per_round": [round(b["rows_per_s"] / e["rows_per_s"], 3)
                                      for b, e in zip(runs["backfill"], runs["engine"])],
        "share_of_engine": {
            "sidecar_stream": round(best["sidecar_stream"]["rows_per_s"] / engine_rps, 3),
            "backfill": round(best["backfill"]["rows_per_s"] / engine_rps, 3)},
        "backfill_share_of_sidecar_stream": round(
            best["backfill"]["rows_per_s"] / best["sidecar_stream"]["rows_per_s"], 3),
        "goal": {"backfill_share_of_engine": 0.8,
                 "met": best["backfill"]["rows_per_s"] / engine_rps >= 0.8},
    }
    write_result("pg_backfill", argv, result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
