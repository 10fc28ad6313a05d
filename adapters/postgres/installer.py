"""Creates and upgrades the `fern` schema with versioned, idempotent SQL migrations.

Migrations are the files `migrations/NNNN_name.sql` shipped with this package, applied in
order, each once, recorded in `fern.migrations`, all under one advisory lock so that
concurrent installs are safe. Optional features that need more than SQL (the synchronous
`fern.embed()` over dblink, which needs the sidecar's endpoint and secret) are installed by
their own module's `install()`, called from here when asked, and may record their own
migrations through `apply_migrations`. `grant_worker` gives a role exactly the privileges a
worker needs (docs/postgres-privileges.md), so workers need not run as the tables' owner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Iterable

import psycopg
from psycopg import sql

_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Any constant works; it only has to be the same for every installer.
_INSTALL_LOCK = 0x6665726E  # "fern"
# Migrations after which every vectorizer's trigger functions are generated again.
_REFRESH_TRIGGERS = {"0002_guards_and_parking"}


@dataclass(frozen=True)
class Migration:
    """One SQL migration: applied once, in `version` order."""

    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def bundled_migrations() -> list[Migration]:
    """The schema migrations shipped in adapters/postgres/migrations/, in order."""
    found = []
    for entry in resources.files("adapters.postgres").joinpath("migrations").iterdir():
        m = _MIGRATION_NAME.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a version number: {versions}")
    return found


def apply_migrations(conn: psycopg.Connection, migrations: Iterable[Migration]) -> list[str]:
    """Apply the migrations not yet recorded in fern.migrations, in one transaction.

    Returns the labels of those applied now (empty when the schema was up to date).
    """
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INSTALL_LOCK,))
        conn.execute("CREATE SCHEMA IF NOT EXISTS fern")
        conn.execute("""CREATE TABLE IF NOT EXISTS fern.migrations (
                            version    int PRIMARY KEY,
                            name       text NOT NULL,
                            applied_at timestamptz NOT NULL DEFAULT now())""")
        done = {row[0] for row in conn.execute("SELECT version FROM fern.migrations")}
        for m in sorted(migrations, key=lambda m: m.version):
            if m.version in done:
                continue
            conn.execute(m.sql)
            conn.execute("INSERT INTO fern.migrations (version, name) VALUES (%s, %s)",
                         (m.version, m.name))
            applied_now.append(m.label)
    return applied_now


def install(conn: psycopg.Connection, *, sql_endpoint: str | None = None,
            sql_endpoint_password: str | None = None) -> list[str]:
    """Create or upgrade the `fern` schema; safe to run any number of times.

    With `sql_endpoint` ("HOST:PORT" of the sidecar's Postgres-protocol endpoint), also
    installs the synchronous `fern.embed()` (adapters/postgres/embed_function.py).
    Returns the labels of the migrations applied by this call.
    """
    applied = apply_migrations(conn, bundled_migrations())
    if _REFRESH_TRIGGERS & set(applied):
        from adapters.postgres.vectorizer import refresh_triggers

        refresh_triggers(conn)
    if sql_endpoint:
        from adapters.postgres import embed_function

        applied += embed_function.install(conn, endpoint=sql_endpoint,
                                          password=sql_endpoint_password)
    return applied


def is_installed(conn: psycopg.Connection) -> bool:
    """True when every bundled migration has been applied."""
    row = conn.execute("SELECT to_regclass('fern.migrations') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return False
    done = {r[0] for r in conn.execute("SELECT version FROM fern.migrations")}
    return all(m.version in done for m in bundled_migrations())


def worker_grants(conn: psycopg.Connection, role: str) -> list[sql.Composed]:
    """The GRANT statements that let `role` run workers for every vectorizer there is now.

    Nothing more: the fern tables' rows it reads, claims, deletes and parks; of each
    vectorized table, SELECT on its key and source columns and UPDATE on its vector column
    only (split mode: SELECT, INSERT, DELETE on the chunk table, and UPDATE on the key
    columns, which PostgreSQL requires for the row lock the worker takes and which the
    worker never writes). Run it again after creating a vectorizer.
    """
    from adapters.postgres.vectorizer import list_vectorizers

    who = sql.Identifier(role)
    database = conn.execute("SELECT current_database()").fetchone()[0]
    out = [sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), who),
           sql.SQL("GRANT USAGE ON SCHEMA fern TO {}").format(who),
           sql.SQL("GRANT SELECT ON fern.migrations, fern.vectorizers, fern.status TO {}")
           .format(who),
           sql.SQL("GRANT UPDATE (parked_error, parked_at) ON fern.vectorizers TO {}").format(who),
           sql.SQL("GRANT SELECT, UPDATE, DELETE ON fern.queue TO {}").format(who),
           sql.SQL("GRANT SELECT, INSERT ON fern.failed TO {}").format(who),
           sql.SQL("GRANT USAGE ON SEQUENCE fern.failed_id_seq TO {}").format(who)]
    schemas: list[str] = []
    for v in list_vectorizers(conn):
        if v.table_schema not in schemas:
            schemas.append(v.table_schema)
            out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(v.table_schema), who))
        readable = list(dict.fromkeys([*v.key_columns, *v.source_columns]))
        out.append(sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, readable)), v.table, who))
        if v.chunking == "split":
            out.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
                sql.SQL(", ").join(map(sql.Identifier, v.key_columns)), v.table, who))
            out.append(sql.SQL("GRANT SELECT, INSERT, DELETE ON {} TO {}").format(v.chunks, who))
        else:
            out.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
                sql.Identifier(v.target_column), v.table, who))
    return out


def grant_worker(conn: psycopg.Connection, role: str) -> list[str]:
    """Run `worker_grants(conn, role)` in one transaction; returns the statements as run."""
    statements = worker_grants(conn, role)
    with conn.transaction():
        for statement in statements:
            conn.execute(statement)
    return [statement.as_string(conn) for statement in statements]
