"""Hostile schema, table and column names (quotes, semicolons, unicode, spaces, `%`, `$1`)
create vectorizers, get embedded, and change nothing else in the database."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "postgres"))
from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: E402,F401
from pg_helpers import cosines, fetch_vectors, run_worker  # noqa: E402

from adapters.postgres.search import search  # noqa: E402
from adapters.postgres.status import status  # noqa: E402
from adapters.postgres.vectorizer import create_vectorizer, drop_vectorizer  # noqa: E402

SCHEMA = 'Sch"ema; DROP SCHEMA public CASCADE; -- %s'
TABLE = "Ta'ble ; DROP TABLE canary; -- % %(x)s 表 $1"
KEY = 'Ke"y %(k)s'
TITLE = "Ti tle'); DELETE FROM canary; --"
BODY = "Bödy $1 %s ☃"
TARGET = 'Vec"; DROP TABLE canary; -- %'

_SNAPSHOT = {
    "relations": """SELECT n.nspname, c.relname, c.relkind FROM pg_class c
                      JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')""",
    "columns": """SELECT n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                         a.attgenerated FROM pg_attribute a
                    JOIN pg_class c ON c.oid = a.attrelid
                    JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
                     AND a.attnum > 0 AND NOT a.attisdropped""",
    "functions": """SELECT n.nspname, p.proname, pg_get_function_identity_arguments(p.oid),
                           p.prosecdef, coalesce(p.proacl::text, '') FROM pg_proc p
                      JOIN pg_namespace n ON n.oid = p.pronamespace
                     WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')""",
    "triggers": """SELECT tgrelid::regclass::text, tgname FROM pg_trigger WHERE NOT tgisinternal""",
    "schemas": "SELECT nspname, coalesce(nspacl::text, '') FROM pg_namespace",
    "roles": "SELECT rolname, rolsuper FROM pg_roles",
    "grants": """SELECT n.nspname, c.relname, coalesce(c.relacl::text, '') FROM pg_class c
                  JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')""",
    "canary": "SELECT md5(string_agg(x::text, ',' ORDER BY x)) FROM canary",
    "source rows": sql.SQL("SELECT md5(string_agg(format('%s|%s|%s', {}, {}, {}), ',' ORDER BY 1)) "
                           "FROM {}").format(sql.Identifier(KEY), sql.Identifier(TITLE),
                                             sql.Identifier(BODY), sql.Identifier(SCHEMA, TABLE)),
}


def snapshot(conn) -> dict[str, set]:
    return {name: set(conn.execute(query).fetchall()) for name, query in _SNAPSHOT.items()}


def _ours(row: tuple, chunk_table: str | None) -> bool:
    """A catalog row a vectorizer on SCHEMA.TABLE may add: on that table, its chunk table
    or its indexes, or a trigger function in schema fern."""
    text = "|".join(map(str, row))
    return (row[0] == "fern" or (row[0] == SCHEMA and (
        row[1] in (TABLE, chunk_table) or str(row[1]).startswith(TABLE[:20])
        or (chunk_table and str(row[1]).startswith(chunk_table[:20]))))
            or "fern_vectorizer_" in text)


@pytest.mark.parametrize("chunking, hybrid", [("truncate", True), ("split", False)])
def test_hostile_names_embed_and_change_nothing_else(conn, fern, pg_db, pg_target, chunking,
                                                     hybrid):
    conn.execute("CREATE TABLE canary (x int PRIMARY KEY)")
    conn.execute("INSERT INTO canary SELECT generate_series(1, 10)")
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
    t = sql.Identifier(SCHEMA, TABLE)
    conn.execute(sql.SQL("CREATE TABLE {} ({} text PRIMARY KEY, {} text, {} text)").format(
        t, sql.Identifier(KEY), sql.Identifier(TITLE), sql.Identifier(BODY)))
    conn.execute(sql.SQL("INSERT INTO {} VALUES ('a''); DROP TABLE canary; --', 'Cats', 'purr'), "
                         "('%s', 'Stocks', 'fell'), ('$1', 'Rain', 'falls in Spain')").format(t))
    before = snapshot(conn)
    extra = {"chunk_tokens": 32, "chunk_overlap": 8} if chunking == "split" else {}
    v = create_vectorizer(conn, (SCHEMA, TABLE), [TITLE, BODY], client=fern,
                          target_column=TARGET, chunking=chunking, hybrid=hybrid, **extra)
    conn.execute(sql.SQL("UPDATE {} SET {} = 'purr loudly' WHERE {} = '%s'").format(
        t, sql.Identifier(BODY), sql.Identifier(KEY)))
    conn.execute(sql.SQL("UPDATE {} SET {} = '%s moved' WHERE {} = '%s'").format(
        t, sql.Identifier(KEY), sql.Identifier(KEY)))
    worker = run_worker(pg_db, pg_target, timeout=120)
    assert worker.stats.vectorizers_parked == 0
    assert all(s.pending == 0 and s.failed == 0 and not s.parked for s in status(conn))

    texts = dict(conn.execute(sql.SQL("SELECT {}, {} || E'\\n\\n' || {} FROM {}").format(
        sql.Identifier(KEY), sql.Identifier(TITLE), sql.Identifier(BODY), t)).fetchall())
    if chunking == "split":
        keys, vecs = fetch_vectors(conn, sql.SQL("SELECT {}, {} FROM {} ORDER BY 1").format(
            sql.Identifier(KEY), sql.Identifier(TARGET), v.chunks))
    else:
        keys, vecs = fetch_vectors(conn, sql.SQL("SELECT {}, {} FROM {} ORDER BY 1").format(
            sql.Identifier(KEY), sql.Identifier(TARGET), t))
    assert sorted(keys) == sorted(texts)
    ref = fern.embed([texts[k] for k in keys], prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999
    hits = search(conn, (SCHEMA, TABLE), "kittens", 1, client=fern, target_column=TARGET)
    assert hits[0].row[TITLE] == "Cats"

    after = snapshot(conn)
    for name in _SNAPSHOT:
        if name == "source rows":
            continue  # two rows were updated above, on purpose
        removed = before[name] - after[name]
        added = {r for r in after[name] - before[name] if not _ours(r, v.chunk_table)}
        assert not removed and not added, (name, removed, added)
    # Dropping the vectorizer and what it made puts the catalog back exactly as it was.
    drop_vectorizer(conn, (SCHEMA, TABLE), TARGET, drop_column=True)
    final = snapshot(conn)
    for name in _SNAPSHOT:
        if name != "source rows":
            assert final[name] == before[name], name
