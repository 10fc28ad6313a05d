"""Installs the synchronous `fern.embed(text)` / `fern.embed_many(text[])` SQL functions, which call the sidecar through dblink.

The functions (migrations/embed_function/1001_embed_function.sql) send
`SELECT * FROM embed_many(ARRAY[...])` to the sidecar's Postgres-protocol endpoint
(`fern serve --pg-port N --token T`, sidecar/pgwire/) over one named dblink connection
per database session, opened on first use and reopened once when it has gone stale.
Where the endpoint is, and how dblink checks its TLS (`sslmode`, `sslrootcert`), lives in
the foreign server `fern_sidecar` (dblink_fdw); the secret lives in the user mapping of the functions' owner, which only that role and superusers
can read. Callers get EXECUTE on the two functions and nothing else: the functions are
SECURITY DEFINER with a fixed search_path.

Use them for queries (`ORDER BY emb <=> fern.embed('…')`) and small writes (a BEFORE
trigger, a generated column). For ingest use a vectorizer (queue + worker): writes then
never wait for the GPU and never fail because the sidecar is down, while a write through
`fern.embed` fails when the sidecar is unreachable, by design.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

import psycopg
from psycopg import sql

from adapters.postgres.migrate import Migration, apply_migrations

SERVER = "fern_sidecar"
MIGRATION = Migration(1001, "embed_function", resources.files("adapters.postgres")
                      .joinpath("migrations", "embed_function", "1001_embed_function.sql")
                      .read_text(encoding="utf-8"))
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
FUNCTIONS = ("fern.embed(text, text, text)", "fern.embed_many(text[], text, text)")
HELPERS = ("fern._sidecar_connect()", "fern._sidecar_query(text)", "fern._with_timeout(text)")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); raises ValueError naming the input."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"sql endpoint {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:5433")
    return host, int(port)


def install(conn: psycopg.Connection, *, endpoint: str | None = None, host: str | None = None,
            port: int | None = None, password: str | None = None, default_model: str = "",
            grant_to: Iterable[str] = ("PUBLIC",), connect_timeout: int = 5,
            sslmode: str = "prefer", sslrootcert: str | None = None) -> list[str]:
    """Create (once) and configure (every call) `fern.embed` and `fern.embed_many`.

    The endpoint is `endpoint` ("HOST:PORT") or `host` + `port`; `password` is the
    sidecar's token. `sslmode` is libpq's, for dblink's connection to the endpoint;
    `verify-ca` / `verify-full` need `sslrootcert`: the CA file on the database server's
    own filesystem (the PostgreSQL server process reads it), or "system". `default_model` "" means the sidecar's default. `grant_to` roles get
    USAGE on schema fern and EXECUTE on the two functions. Needs the right to CREATE
    EXTENSION dblink (once) and to own the functions. Returns the migrations applied now.
    """
    if endpoint:
        host, port = parse_endpoint(endpoint)
    if not host or not port:
        raise ValueError("install: give the sidecar's SQL endpoint as endpoint='HOST:PORT' "
                         "or host= and port=")
    if not password:
        raise ValueError("install: the SQL endpoint needs a password (the sidecar's --token)")
    if sslmode not in SSLMODES:
        raise ValueError(f"install: sslmode {sslmode!r} is not one of {', '.join(SSLMODES)}")
    if sslmode.startswith("verify-") and not sslrootcert:
        raise ValueError(f"install: sslmode {sslmode} needs sslrootcert (the CA file the "
                         "database server reads, or 'system')")
    applied = apply_migrations(conn, [MIGRATION])
    with conn.transaction():
        _set_server_options(conn, {"host": host, "port": str(port), "dbname": "fern",
                                   "application_name": "fern.embed",
                                   "connect_timeout": str(connect_timeout), "sslmode": sslmode,
                                   "sslrootcert": sslrootcert})
        owner = conn.execute("SELECT r.rolname FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner "
                             "WHERE p.oid = 'fern.embed(text, text, text)'::regprocedure").fetchone()[0]
        _set_user_mapping(conn, owner, {"user": "fern", "password": password})
        schemas = [row[0] for row in conn.execute(
            "SELECT DISTINCT n.nspname FROM pg_extension e JOIN pg_namespace n "
            "ON n.oid = e.extnamespace WHERE e.extname IN ('dblink', 'vector') ORDER BY 1")]
        path = sql.SQL(", ").join([sql.Identifier(s) for s in
                                   ["pg_catalog", *[s for s in schemas if s != "pg_catalog"],
                                    "pg_temp"]])
        for signature in FUNCTIONS + HELPERS:
            conn.execute(sql.SQL("ALTER FUNCTION {} SET search_path = {}")
                         .format(sql.SQL(signature), path))
        for signature in FUNCTIONS:
            if default_model:
                conn.execute(sql.SQL("ALTER FUNCTION {} SET fern.default_model = {}")
                             .format(sql.SQL(signature), sql.Literal(default_model)))
            else:
                conn.execute(sql.SQL("ALTER FUNCTION {} RESET fern.default_model")
                             .format(sql.SQL(signature)))
        for role in grant_to:
            grantee = sql.SQL("PUBLIC") if role.upper() == "PUBLIC" else sql.Identifier(role)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA fern TO {}").format(grantee))
            for signature in FUNCTIONS:
                conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}")
                             .format(sql.SQL(signature), grantee))
    return applied


def _set_server_options(conn: psycopg.Connection, options: dict[str, str | None]) -> None:
    """Set each option; one given as None is dropped where present (so a re-install
    without sslrootcert does not leave a stale one)."""
    row = conn.execute("SELECT srvoptions FROM pg_foreign_server WHERE srvname = %s",
                       (SERVER,)).fetchone()
    present = {o.split("=", 1)[0] for o in (row[0] or [])}
    conn.execute(sql.SQL("ALTER SERVER {} OPTIONS ({})").format(
        sql.Identifier(SERVER), _option_list(options, present)))


def _set_user_mapping(conn: psycopg.Connection, role: str, options: dict[str, str]) -> None:
    grantee = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE USER MAPPING IF NOT EXISTS FOR {} SERVER {}")
                 .format(grantee, sql.Identifier(SERVER)))
    row = conn.execute("SELECT umoptions FROM pg_user_mappings WHERE srvname = %s AND usename = %s",
                       (SERVER, role)).fetchone()
    present = {o.split("=", 1)[0] for o in (row[0] or [])}
    conn.execute(sql.SQL("ALTER USER MAPPING FOR {} SERVER {} OPTIONS ({})").format(
        grantee, sql.Identifier(SERVER), _option_list(options, present)))


def _option_list(options: dict[str, str | None], present: set[str]) -> sql.Composable:
    items = []
    for name, value in options.items():
        if value is None:
            if name in present:
                items.append(sql.SQL("DROP {}").format(sql.Identifier(name)))
            continue
        items.append(sql.SQL("{} {} {}").format(sql.SQL("SET" if name in present else "ADD"),
                                                sql.Identifier(name), sql.Literal(value)))
    return sql.SQL(", ").join(items)
