"""Per-call overhead of the SQL function `fern.embed()` (dblink, persistent connection) against the gRPC client on the same text.

    python -m benchmarks.pg_embed_function [--calls 300] [--device auto] [--out FILE]

Starts an embedded PostgreSQL 18 and `fern serve --pg-port` on this machine, installs
fern.embed, then times, interleaved call by call on one short text:
  grpc            FernClient.embed([text]) (the reference)
  endpoint        psycopg straight to the sidecar's Postgres endpoint: SELECT embed('…')
  sql_persistent  psycopg -> PostgreSQL: SELECT fern.embed(%s), dblink connection kept
  sql_reconnect   the same after dblink_disconnect: what every call would pay without it
  pg_roundtrip    psycopg -> PostgreSQL: SELECT %s::text (the floor of any SQL call)
and, for 100 rows, fern.embed per row vs fern.embed_many vs one gRPC call. Writes JSON
with the exact command, machine and date (default: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psycopg

TEXT = "How much does a SQL call add on top of the embedding itself?"
TOKEN = "bench-pg-endpoint"


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples)
    return {"calls": len(ms), "p50_ms": round(statistics.median(ms), 4),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> dict[str, object]:
    info: dict[str, object] = {"platform": platform.platform(), "python": platform.python_version(),
                               "cpu_count": os.cpu_count(), "processor": platform.processor()}
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["cuda"] = None
    return info


def run(calls: int, device: str, log_dir: Path) -> dict[str, object]:
    from adapters.postgres import embed_function
    from adapters.postgres.embedded import EmbeddedPostgres
    from benchmarks.server import free_port, start_sidecar
    from sidecar.client import FernClient

    pg_port = free_port()
    served = start_sidecar(None, device=device, log_dir=log_dir, name="pg-embed-function",
                           extra=["--token", TOKEN, "--pg-port", str(pg_port)])
    try:
        with EmbeddedPostgres() as pg, FernClient(served.target, token=TOKEN) as client, \
                psycopg.connect(pg.dsn, autocommit=True) as db, \
                psycopg.connect(f"host=127.0.0.1 port={pg_port} user=fern dbname=fern "
                                f"password={TOKEN}", autocommit=True,
                                prepare_threshold=None) as endpoint:  # simple protocol, as dblink
            embed_function.install(db, endpoint=f"127.0.0.1:{pg_port}", password=TOKEN)
            literal = "'" + TEXT.replace("'", "''") + "'"
            cases = {
                "grpc": lambda: client.embed([TEXT]),
                "endpoint": lambda: endpoint.execute(f"SELECT embed({literal})").fetchall(),
                "sql_persistent": lambda: db.execute("SELECT fern.embed(%s)", [TEXT]).fetchall(),
                "pg_roundtrip": lambda: db.execute("SELECT %s::text", [TEXT]).fetchall(),
            }

            def reconnect() -> float:
                db.execute("SELECT dblink_disconnect('fern_sidecar')")
                return timed(cases["sql_persistent"])

            for fn in cases.values():        # warm-up: model, graphs, connections, plans
                for _ in range(20):
                    fn()
            samples: dict[str, list[float]] = {name: [] for name in [*cases, "sql_reconnect"]}
            for _ in range(calls):           # interleaved, so drift hits every case alike
                for name, fn in cases.items():
                    samples[name].append(timed(fn))
                samples["sql_reconnect"].append(reconnect())
            single = {name: summary(s) for name, s in samples.items()}

            rows = [f"row {i}: {TEXT}" for i in range(100)]
            db.execute("CREATE TEMP TABLE bench_rows (body text)")
            db.execute("INSERT INTO bench_rows SELECT unnest(%s::text[])", [rows])
            batch_cases = {
                "fern_embed_per_row": lambda: db.execute(
                    "SELECT fern.embed(body) FROM bench_rows").fetchall(),
                "fern_embed_many": lambda: db.execute(
                    "SELECT * FROM fern.embed_many((SELECT array_agg(body) FROM bench_rows))").fetchall(),
                "grpc_one_call": lambda: client.embed(rows),
            }
            batch_samples: dict[str, list[float]] = {name: [] for name in batch_cases}
            for fn in batch_cases.values():
                fn()
            for _ in range(max(5, calls // 30)):
                for name, fn in batch_cases.items():
                    batch_samples[name].append(timed(fn))
            batch = {name: {**summary(s), "per_row_ms": round(statistics.median(s) * 1e3 / 100, 4)}
                     for name, s in batch_samples.items()}
    finally:
        served.stop()
    def paired(a: str, b: str) -> dict[str, float]:
        """Median and quartiles of call-by-call differences (the cases ran interleaved)."""
        diffs = sorted((x - y) * 1e3 for x, y in zip(samples[a], samples[b]))
        q = statistics.quantiles(diffs, n=4)
        return {"median_ms": round(q[1], 4), "q1_ms": round(q[0], 4), "q3_ms": round(q[2], 4)}

    return {
        "text": TEXT,
        "single_call": single,
        "overhead_paired": {
            "sql_persistent_minus_grpc": paired("sql_persistent", "grpc"),
            "sql_reconnect_minus_grpc": paired("sql_reconnect", "grpc"),
            "endpoint_minus_grpc": paired("endpoint", "grpc"),
            "handshake_saved_by_persistent_connection": paired("sql_reconnect", "sql_persistent"),
        },
        "rows_100": batch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="fern-bench-pg-") as logs:
        results = run(args.calls, args.device, Path(logs))
    report = {
        "benchmark": "pg_embed_function",
        "command": " ".join(["python -m benchmarks.pg_embed_function", *(argv or sys.argv[1:])]),
        "date_utc": started.isoformat(timespec="seconds"),
        "machine": machine(),
        "device": args.device,
        **results,
    }
    where = "cuda" if report["machine"]["cuda"] else "cpu"
    out = args.out or Path(__file__).with_name("results") / where / "pg_embed_function.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["overhead_paired"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
