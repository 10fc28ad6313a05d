"""Hostile schema, table and column names work end to end and inject nothing."""

from __future__ import annotations

import pytest
from pg_helpers import cosines, fetch_vectors, run_worker
from psycopg import sql

from adapters.postgres.search import search
from adapters.postgres.vectorizer import (VectorizerError, create_vectorizer, drop_vectorizer,
                                          get_vectorizer, split_table_name)

SCHEMA = 'Sch"ema; DROP TABLE canary; --'
TABLE = "Robert'); DROP TABLE canary;--"
KEY = 'Id "key"'
TITLE = "Title'; DELETE FROM canary; --"
BODY = "bOdY}{"  # braces need escaping in a template
TARGET = 'Vec"; DROP TABLE canary'


def test_hostile_identifiers_work_and_inject_nothing(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE canary (x int)")
    conn.execute("INSERT INTO canary VALUES (1)")
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
    t = sql.Identifier(SCHEMA, TABLE)
    conn.execute(sql.SQL("CREATE TABLE {} ({} text PRIMARY KEY, {} text, {} text)").format(
        t, sql.Identifier(KEY), sql.Identifier(TITLE), sql.Identifier(BODY)))
    conn.execute(sql.SQL("INSERT INTO {} VALUES ('a''; --', 'Cats', 'purr softly'), "
                         "('b', 'Stocks', 'fell sharply')").format(t))
    template = "{" + TITLE + "}: {" + BODY.replace("}", "}}") + "}"
    v = create_vectorizer(conn, (SCHEMA, TABLE), template, client=fern, target_column=TARGET,
                          hybrid=True)
    assert v.source_columns == (TITLE, BODY)
    conn.execute(sql.SQL("INSERT INTO {} VALUES ('c', 'Rain', 'falls in Spain')").format(t))
    conn.execute(sql.SQL("UPDATE {} SET {} = 'purr loudly' WHERE {} = 'a''; --'").format(
        t, sql.Identifier(BODY), sql.Identifier(KEY)))
    run_worker(pg_db, pg_target)
    keys, vecs = fetch_vectors(conn, sql.SQL("SELECT {}, {} FROM {} ORDER BY 1").format(
        sql.Identifier(KEY), sql.Identifier(TARGET), t))
    assert keys == ["a'; --", "b", "c"]
    texts = ["Cats: purr loudly", "Stocks: fell sharply", "Rain: falls in Spain"]
    ref = fern.embed(texts, prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999
    hits = search(conn, (SCHEMA, TABLE), "kittens", 1, client=fern)
    assert hits[0].row[KEY] == "a'; --"
    # Also found by the SQL-quoted spelling of the name.
    quoted = '"' + SCHEMA.replace('"', '""') + '"."' + TABLE.replace('"', '""') + '"'
    assert get_vectorizer(conn, quoted).id == v.id
    drop_vectorizer(conn, (SCHEMA, TABLE), drop_column=True)
    assert conn.execute("SELECT x FROM canary").fetchall() == [(1,)]
    assert conn.execute("SELECT count(*) FROM fern.vectorizers").fetchone() == (0,)


def test_mixed_case_names_are_taken_verbatim(conn, fern, pg_db, pg_target):
    conn.execute('CREATE TABLE "MixedCase" ("ID" int PRIMARY KEY, "Body" text)')
    conn.execute('CREATE TABLE mixedcase (id int PRIMARY KEY, body text)')
    conn.execute('INSERT INTO "MixedCase" VALUES (1, \'hello\')')
    v = create_vectorizer(conn, "MixedCase", ["Body"], client=fern)
    assert (v.table_name, v.key_columns) == ("MixedCase", ("ID",))
    run_worker(pg_db, pg_target)
    assert conn.execute('SELECT "embedding" IS NOT NULL FROM "MixedCase"').fetchone() == (True,)
    assert conn.execute("SELECT count(*) FROM fern.vectorizers WHERE table_name = 'mixedcase'"
                        ).fetchone() == (0,)


@pytest.mark.parametrize("table, reading", [
    ('"My.Schema"."T"', ("My.Schema", "T")),
    ('"a""b"', (None, 'a"b')),
    ('"a""b"."c"""', ('a"b', 'c"')),
])
def test_quoted_table_names_read_as_sql(table, reading):
    assert split_table_name(table) == [reading]


@pytest.mark.parametrize("table, message", [
    ('"abc', 'table name \'"abc\': unclosed double quote'),
    ('"a""', 'table name \'"a""\': unclosed double quote'),
    ('"a"x', 'table name \'"a"x\': expected "schema"."table"'),
    ('"a"."b"."c"', 'table name \'"a"."b"."c"\': expected "schema"."table"'),
    ('"a".b', 'table name \'"a".b\': expected a double quote at 4'),
    ('"a".', 'table name \'"a".\': expected "schema"."table"'),  # a schema with no table
])
def test_bad_quoted_table_names_are_named_in_the_error(table, message):
    with pytest.raises(VectorizerError) as err:
        split_table_name(table)
    assert str(err.value) == message
