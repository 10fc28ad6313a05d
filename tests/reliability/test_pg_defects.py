"""Queue and worker defects that lost rows or stopped all embedding, each held fixed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "postgres"))
from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: E402,F401
from pg_helpers import cosines, fetch_vectors, run_worker  # noqa: E402

from adapters.postgres.status import status  # noqa: E402
from adapters.postgres.vectorizer import create_vectorizer, drop_vectorizer  # noqa: E402


def _texts(conn, table: sql.Composable, key: str, text_sql: sql.Composable) -> dict:
    return dict(conn.execute(sql.SQL("SELECT {}, {} FROM {}").format(
        sql.Identifier(key), text_sql, table)).fetchall())


@pytest.mark.parametrize("chunking", ["truncate", "split"])
def test_rows_rekeyed_while_queued_are_embedded_under_their_new_key(conn, fern, pg_db,
                                                                     pg_target, chunking):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO items SELECT g, 'row ' || g || ' about rivers' "
                 "FROM generate_series(1, 300) g")
    extra = {"chunk_tokens": 64} if chunking == "split" else {}
    v = create_vectorizer(conn, "items", ["body"], client=fern, chunking=chunking, **extra)
    # Every row is queued; re-key 50 of them (a swap of keys within the table included).
    conn.execute("UPDATE items SET id = id + 1000 WHERE id % 6 = 0")
    for old, new in ((1, -1), (2, 1), (-1, 2)):
        conn.execute("UPDATE items SET id = %s WHERE id = %s", (new, old))
    run_worker(pg_db, pg_target)
    assert conn.execute("SELECT count(*) FROM fern.queue").fetchone() == (0,)
    if chunking == "split":
        ids, vecs = fetch_vectors(conn, "SELECT i.id, c.embedding FROM items i JOIN "
                                        "items_embedding_chunks c ON c.id = i.id ORDER BY i.id")
        assert conn.execute("SELECT count(*) FROM items_embedding_chunks c WHERE NOT EXISTS "
                            "(SELECT 1 FROM items i WHERE i.id = c.id)").fetchone() == (0,)
    else:
        ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items "
                                        "WHERE embedding IS NOT NULL ORDER BY id")
    expected = sorted(r[0] for r in conn.execute("SELECT id FROM items"))
    assert ids == expected, f"{len(set(expected) - set(ids))} of 300 rows have no vector"
    texts = dict(conn.execute("SELECT id, body FROM items").fetchall())
    ref = fern.embed([texts[i] for i in ids], prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999


HOSTILE = [("growth_%", "pct %(vid)s %s"), ("données %s", "colonne $1 %%"),
           ("t 100%", "body")]


def test_percent_and_placeholder_names_embed_and_do_not_stop_others(conn, fern, pg_db,
                                                                    pg_target):
    conn.execute("CREATE TABLE plain (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO plain SELECT g, 'plain row ' || g FROM generate_series(1, 20) g")
    create_vectorizer(conn, "plain", ["body"], client=fern)
    for table, column in HOSTILE:
        t = sql.Identifier(table)
        conn.execute(sql.SQL("CREATE TABLE {} ({} int PRIMARY KEY, {} text)").format(
            t, sql.Identifier("k %s"), sql.Identifier(column)))
        conn.execute(sql.SQL("INSERT INTO {} SELECT g, 'hostile ' || g || ' 100%% sure' "
                             "FROM generate_series(1, 10) g").format(t))
        create_vectorizer(conn, table, "{" + column + "} %s", client=fern, hybrid=True)
    run_worker(pg_db, pg_target, timeout=120)
    assert conn.execute("SELECT count(embedding) FROM plain").fetchone() == (20,)
    for table, column in HOSTILE:
        t = sql.Identifier(table)
        keys, vecs = fetch_vectors(conn, sql.SQL("SELECT {}, embedding FROM {} ORDER BY 1").format(
            sql.Identifier(column), t))
        assert len(keys) == 10 and all(vecs.any(1)), table
        ref = fern.embed([f"{k} %s" for k in keys], prompt="passage").vectors
        assert cosines(vecs, ref).min() >= 0.99999
    assert all(s.failed == 0 and s.pending == 0 for s in status(conn))


def test_a_broken_vectorizer_is_parked_with_its_error_while_others_go_on(conn, fern, pg_db,
                                                                       pg_target):
    conn.execute("CREATE TABLE good (id int PRIMARY KEY, body text)")
    conn.execute("CREATE TABLE bad (id int PRIMARY KEY, body text, extra text)")
    create_vectorizer(conn, "bad", "{body} {extra}", client=fern)
    create_vectorizer(conn, "good", ["body"], client=fern)
    conn.execute("INSERT INTO bad SELECT g, 'b', 'x' FROM generate_series(1, 5) g")
    # The source column goes away behind Fern's back: every claim of `bad` fails in SQL.
    conn.execute("ALTER TABLE bad RENAME COLUMN extra TO extra2")
    conn.execute("INSERT INTO good SELECT g, 'good row ' || g FROM generate_series(1, 20) g")
    worker = run_worker(pg_db, pg_target, timeout=120)
    assert conn.execute("SELECT count(embedding) FROM good").fetchone() == (20,)
    assert worker.stats.vectorizers_parked == 1
    st = {s.name: s for s in status(conn)}
    assert st["public.bad.embedding"].parked
    assert "extra" in st["public.bad.embedding"].last_error
    assert st["public.bad.embedding"].pending == 5  # parked, not lost
    assert not st["public.good.embedding"].parked


def test_drop_vectorizer_with_its_column_also_drops_the_hybrid_tsvector_and_index(conn, fern):
    conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text)")
    create_vectorizer(conn, "docs", ["body"], client=fern, hybrid=True)
    conn.execute("CREATE TABLE own (id int PRIMARY KEY, body text, "
                 "tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', body)) STORED)")
    create_vectorizer(conn, "own", ["body"], client=fern, hybrid=True, tsv_column="tsv")

    def columns(table: str) -> list[str]:
        return [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum", (table,))]

    def indexes(table: str) -> list[str]:
        return [r[0] for r in conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass "
            "AND NOT indisprimary ORDER BY 1", (table,))]

    assert columns("docs") == ["id", "body", "embedding", "embedding_sparse", "embedding_tsv"]
    drop_vectorizer(conn, "docs", drop_column=True)
    assert columns("docs") == ["id", "body"]
    assert indexes("docs") == []
    # A tsvector column the user made stays (only the index Fern built for it goes).
    drop_vectorizer(conn, "own", drop_column=True)
    assert columns("own") == ["id", "body", "tsv"]
    assert indexes("own") == []


def test_search_finds_rows_of_a_table_named_with_percent(conn, fern, pg_db, pg_target):
    from adapters.postgres.search import search

    conn.execute('CREATE TABLE "growth_%" ("k %s" int PRIMARY KEY, "pct %(vid)s %s" text)')
    conn.execute("""INSERT INTO "growth_%" VALUES (1, 'cats purr'), (2, 'stocks fell')""")
    create_vectorizer(conn, "growth_%", ["pct %(vid)s %s"], client=fern, hybrid=True)
    run_worker(pg_db, pg_target)
    for hybrid in (False, True):
        hits = search(conn, "growth_%", "kittens", 1, client=fern, hybrid=hybrid,
                      where=sql.SQL("{} > %s").format(sql.Identifier("t", "k %s")),
                      params=[0])
        assert hits[0].row["k %s"] == 1
