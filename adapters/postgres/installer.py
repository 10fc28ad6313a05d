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

import psycopg
from psycopg import sql

from adapters.postgres.migrate import Migration, apply_migrations, bundled_migrations  # noqa: F401 - public here too

# Migrations after which every vectorizer's trigger functions are generated again.
_REFRESH_TRIGGERS = {"0002_guards_and_parking"}


def install(conn: psycopg.Connection, *, sql_endpoint: str | None = None,
            sql_endpoint_password: str | None = None) -> list[str]:
    """Create or upgrade the `fern` schema; safe to run any number of times.

    With `sql_endpoint` ("HOST:PORT" of the sidecar's Postgres-protocol endpoint), also
    installs the synchronous `fern.embed()` (adapters/postgres/embed_function.py).
    Returns the labels of the migrations applied by this call.
    """
    applied = apply_migrations(conn, bundled_migrations())
    if _REFRESH_TRIGGERS & set(applied):
        from adapters.postgres.triggers import refresh_triggers

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
    (and sparse column) only (split mode: SELECT, INSERT, DELETE on the chunk table, and UPDATE on the key
    columns, which PostgreSQL requires for the row lock the worker takes and which the
    worker never writes). Run it again after creating a vectorizer.
    """
    from adapters.postgres.catalog import list_vectorizers

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
            written = [v.target_column] + ([v.sparse_column] if v.sparse_column else [])
            out.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
                sql.SQL(", ").join(map(sql.Identifier, written)), v.table, who))
    return out


def grant_worker(conn: psycopg.Connection, role: str) -> list[str]:
    """Run `worker_grants(conn, role)` in one transaction; returns the statements as run."""
    statements = worker_grants(conn, role)
    with conn.transaction():
        for statement in statements:
            conn.execute(statement)
    return [statement.as_string(conn) for statement in statements]
