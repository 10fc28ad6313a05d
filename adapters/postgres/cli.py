"""The `fern pg` verbs (install, vectorize, worker, status), registered by sidecar.cli."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `pg` verb and its sub-verbs to the `fern` command's subparsers."""
    parser = subparsers.add_parser(
        "pg", help="PostgreSQL + pgvector: install, vectorize, worker, status",
        description="Keep pgvector columns true to their text with Fern.")
    verbs = parser.add_subparsers(dest="pg_verb", metavar="VERB")
    verbs.required = True

    def dsn_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dsn", default=os.environ.get("FERN_PG_DSN"),
                       required=os.environ.get("FERN_PG_DSN") is None,
                       help="libpq connection string (env FERN_PG_DSN)")

    def target_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=None,
                       help="the sidecar's gRPC address (env FERN_TARGET)")

    p = verbs.add_parser("install", help="create or upgrade the fern schema (idempotent)")
    dsn_arg(p)
    p.add_argument("--sql-endpoint", default=os.environ.get("FERN_PG_SQL_ENDPOINT"),
                   metavar="HOST:PORT",
                   help="also install fern.embed() over dblink, calling the sidecar's "
                        "Postgres-protocol endpoint at HOST:PORT (env FERN_PG_SQL_ENDPOINT)")
    p.add_argument("--sql-endpoint-password", default=os.environ.get("FERN_TOKEN"),
                   help="the endpoint's password, i.e. the sidecar's token (env FERN_TOKEN)")
    p.add_argument("--sql-sslmode", default=os.environ.get("FERN_PG_SQL_SSLMODE", "prefer"),
                   choices=("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
                   help="libpq sslmode of dblink's connection to the endpoint (default prefer; "
                        "env FERN_PG_SQL_SSLMODE)")
    p.add_argument("--sql-sslrootcert", default=os.environ.get("FERN_PG_SQL_SSLROOTCERT"),
                   metavar="CA.pem",
                   help="CA file that signed the endpoint's certificate, as a path on the "
                        "database server (needed for verify-ca / verify-full; env "
                        "FERN_PG_SQL_SSLROOTCERT)")
    p.set_defaults(func=_install)

    p = verbs.add_parser("vectorize", help="attach a vectorizer to a table and backfill it")
    dsn_arg(p)
    target_arg(p)
    p.add_argument("table", help="table name, optionally schema-qualified as schema.table")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--column", "-c", action="append", dest="columns",
                     help="source text column (repeatable; joined by blank lines)")
    src.add_argument("--template", help='e.g. "{title}\\n\\n{body}" (braces name columns)')
    p.add_argument("--target-column", default="embedding", help="vector column (default embedding)")
    p.add_argument("--model", default="", help="model name (default: the sidecar's default)")
    p.add_argument("--prompt", default="passage",
                   help="prompt name documents are embedded with (default passage)")
    p.add_argument("--chunking", choices=("truncate", "split"), default="truncate",
                   help="truncate at the model's limit, or split into a chunk table")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="chunk size in tokens for --chunking split (default: model limit)")
    p.add_argument("--chunk-overlap", type=int, default=32, help="overlap in tokens (split)")
    p.add_argument("--hybrid", action="store_true",
                   help="also keep a tsvector column with a GIN index for hybrid search")
    p.add_argument("--language", default="english", help="text search configuration (hybrid)")
    p.add_argument("--model-change", action="store_true",
                   help="the vectorizer exists: re-embed with --model into a new column in "
                        "the background, then swap (zero downtime)")
    p.set_defaults(func=_vectorize)

    p = verbs.add_parser("worker", help="embed queued rows (run any number in parallel)")
    dsn_arg(p)
    target_arg(p)
    p.add_argument("--batch-size", type=int, default=128, help="rows per embedding request")
    p.add_argument("--once", action="store_true", help="exit when the queue is empty")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar (auto: when stderr is a terminal)")
    p.set_defaults(func=_worker)

    p = verbs.add_parser("status", help="pending, in-flight and failed rows per vectorizer")
    dsn_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_status)
    return parser


def _install(args: argparse.Namespace) -> int:
    import psycopg

    from adapters.postgres import embed_function
    from adapters.postgres.installer import install

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        applied = install(conn)
        if args.sql_endpoint:
            try:
                applied += embed_function.install(
                    conn, endpoint=args.sql_endpoint, password=args.sql_endpoint_password,
                    sslmode=args.sql_sslmode, sslrootcert=args.sql_sslrootcert)
            except ValueError as error:
                raise SystemExit(f"fern pg {error}") from None
    print(f"fern schema up to date ({len(applied)} migration(s) applied"
          + (f": {', '.join(applied)})" if applied else ")"))
    return 0


def _vectorize(args: argparse.Namespace) -> int:
    import psycopg

    from adapters.postgres.vectorizer import alter_vectorizer, create_vectorizer
    from sidecar.client import FernClient

    source = args.template if args.template is not None else args.columns
    with psycopg.connect(args.dsn, autocommit=True) as conn, FernClient(args.target) as client:
        if args.model_change:
            v = alter_vectorizer(conn, args.table, client=client, model=args.model,
                                 target_column=args.target_column)
            print(f"re-embedding {v.qualified_table} with {args.model or 'the default model'} "
                  f"into {v.target_column!r}; workers swap it in when done")
            return 0
        v = create_vectorizer(conn, args.table, source, client=client,
                              target_column=args.target_column, model=args.model,
                              prompt=args.prompt, chunking=args.chunking,
                              chunk_tokens=args.chunk_tokens, chunk_overlap=args.chunk_overlap,
                              hybrid=args.hybrid, language=args.language)
    print(f"vectorizer {v.id} on {v.qualified_table}.{v.target_column} "
          f"({v.model}, {v.dimensions} dims): {v.backfilled} row(s) queued")
    return 0


def _worker(args: argparse.Namespace) -> int:
    import time

    import psycopg

    from adapters.postgres.worker import SchemaMissing, Worker, WorkerConfig

    progress = {"auto": sys.stderr.isatty(), "on": True, "off": False}[args.progress]
    config = WorkerConfig(dsn=args.dsn, target=args.target, batch_size=args.batch_size,
                          progress=progress)
    worker = Worker(config)
    try:
        while True:
            try:
                worker.run(until_empty=args.once)
                return 0
            except psycopg.OperationalError as err:
                if args.once:
                    raise
                # The database restarted or the network blinked: claims of the lost
                # connections are free again; reconnect and go on.
                print(f"fern pg worker: database connection lost ({err}); reconnecting in 2 s",
                      file=sys.stderr)
                time.sleep(2.0)
    except KeyboardInterrupt:
        worker.stop()
        return 0
    except SchemaMissing as err:
        print(f"fern pg worker: {err}", file=sys.stderr)
        return 2
    finally:
        worker.close()


def _status(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    import psycopg

    from adapters.postgres.status import status

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        rows = status(conn)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], default=str, indent=2))
        return 0
    print(f"{'id':>3}  {'vectorizer':<40} {'pending':>8} {'in flight':>9} {'failed':>7}  last error")
    for r in rows:
        print(f"{r.vectorizer_id:>3}  {r.name[:40]:<40} {r.pending:>8} {r.in_flight:>9} "
              f"{r.failed:>7}  {(r.last_error or '')[:60]}")
    return 0
