"""Freshness: time from an INSERT's COMMIT to its vector being readable, with an idle sidecar.

One embedded PostgreSQL 18 (adapters/postgres/embedded.py), one `fern serve` and one
`fern pg worker`, each in its own process. 200 single-row inserts (autocommit, one at a
time, with a pause between them so the sidecar is idle when each arrives); after each
COMMIT a second connection polls every `--poll-ms` until `embedding IS NOT NULL`.
Reported: p50 / p90 / p99 / max in milliseconds (goal: p50 <= 100 ms), and, interleaved,
the sidecar's own latency for one text, so the adapter's share (NOTIFY, claim, stream,
write, commit) is visible.

Usage: python -m benchmarks.pg_freshness [--rows 200] [--device cpu] [--target HOST:PORT]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.pg_common import running_worker, start_sidecar, write_result

TEXTS = ["A customer asked how to reset the router after a firmware update.",
         "The museum opens a new wing for modern sculpture next spring.",
         "Heavy rain is expected across the northern valleys tonight.",
         "Our quarterly report shows steady growth in the subscription business."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=None, help="use a running sidecar at HOST:PORT")
    parser.add_argument("--poll-ms", type=float, default=1.0)
    parser.add_argument("--pause-ms", type=float, default=50.0, help="idle time between inserts")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/pg_freshness.json"))
    args = parser.parse_args(argv)

    import psycopg

    from adapters.postgres.embedded import EmbeddedPostgres
    from adapters.postgres.installer import install
    from adapters.postgres.vectorizer import create_vectorizer
    from sidecar.client import FernClient

    side = None if args.target else start_sidecar(args.device)
    target = args.target or side.target
    latencies: list[float] = []
    sidecar_ms: list[float] = []
    try:
        with EmbeddedPostgres() as pg, FernClient(target) as fern, \
                psycopg.connect(pg.dsn, autocommit=True) as conn, \
                psycopg.connect(pg.dsn, autocommit=True) as reader:
            install(conn)
            conn.execute("CREATE TABLE notes (id int PRIMARY KEY, body text)")
            create_vectorizer(conn, "notes", ["body"], client=fern)
            with running_worker(pg.dsn, target, batch_size=64):
                for i in range(-5, args.rows):  # 5 warm-up rows, not counted
                    conn.execute("INSERT INTO notes VALUES (%s, %s)",
                                 (i, f"{TEXTS[i % len(TEXTS)]} (note {i})"))
                    committed = time.perf_counter()
                    while not reader.execute("SELECT embedding IS NOT NULL FROM notes WHERE id = %s",
                                             (i,)).fetchone()[0]:
                        if time.perf_counter() - committed > 60:
                            raise TimeoutError(f"row {i} got no vector in 60 s")
                        time.sleep(args.poll_ms / 1000)
                    if i >= 0:
                        latencies.append((time.perf_counter() - committed) * 1000)
                    time.sleep(args.pause_ms / 1000)
                    # Baseline, interleaved: the sidecar alone on the same kind of text.
                    started = time.perf_counter()
                    fern.embed([f"{TEXTS[i % len(TEXTS)]} (probe {i})"], lane="batch",
                               prompt="passage")
                    if i >= 0:
                        sidecar_ms.append((time.perf_counter() - started) * 1000)
                    time.sleep(args.pause_ms / 1000)
    finally:
        if side is not None:
            side.stop()
    result = {
        "what": "COMMIT of a single-row INSERT -> its vector readable by another connection",
        "setup": {"rows": args.rows, "poll_ms": args.poll_ms, "pause_ms": args.pause_ms,
                  "device": args.device, "postgres": "embedded 18 + pgvector (fsync off)",
                  "worker": "fern pg worker, own process", "sidecar": "fern serve, own process"},
        "latency_ms": {"p50": round(percentile(latencies, 0.50), 2),
                       "p90": round(percentile(latencies, 0.90), 2),
                       "p99": round(percentile(latencies, 0.99), 2),
                       "max": round(max(latencies), 2),
                       "mean": round(statistics.fmean(latencies), 2)},
        "sidecar_alone_ms": {"what": "FernClient.embed of one text (BATCH lane), interleaved",
                             "p50": round(percentile(sidecar_ms, 0.50), 2),
                             "p99": round(percentile(sidecar_ms, 0.99), 2)},
        "adapter_overhead_p50_ms": round(percentile(latencies, 0.5) - percentile(sidecar_ms, 0.5), 2),
        "goal": {"p50_ms": 100.0, "met": percentile(latencies, 0.50) <= 100.0},
    }
    write_result("pg_freshness", argv, result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
