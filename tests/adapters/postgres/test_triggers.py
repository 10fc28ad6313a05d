"""Triggers: what enqueues work (and what must not), chunk clean-up, rollback, no user-table state."""

from __future__ import annotations

import psycopg
import pytest

from adapters.postgres.vectorizer import VectorizerError, create_vectorizer, drop_vectorizer


def queued(conn) -> list:
    return [r[0] for r in conn.execute("SELECT row_key FROM fern.queue ORDER BY id")]


@pytest.fixture
def docs(conn, fern):
    conn.execute("CREATE TABLE docs (id int PRIMARY KEY, title text, body text, views int)")
    conn.execute("INSERT INTO docs VALUES (1, 't1', 'b1', 0), (2, 't2', 'b2', 0)")
    v = create_vectorizer(conn, "docs", "{title}\n\n{body}", client=fern)
    return v


def test_backfill_enqueues_every_existing_row_and_adds_column_and_index(conn, docs):
    assert docs.backfilled == 2
    assert sorted(queued(conn)) == [[1], [2]]
    col = conn.execute("""SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                          WHERE attrelid = 'docs'::regclass AND attname = 'embedding'""").fetchone()
    assert col == ("vector(384)",)
    idx = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'docs' "
                       "AND indexdef LIKE '%hnsw%'").fetchone()
    assert idx and "vector_cosine_ops" in idx[0]


def test_insert_enqueues_and_notifies(conn, docs, pg_db):
    with psycopg.connect(pg_db, autocommit=True) as listener:
        listener.execute("LISTEN fern_queue")
        conn.execute("INSERT INTO docs VALUES (3, 't3', 'b3', 0), (4, 't4', 'b4', 0)")
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert notes and notes[0].payload == str(docs.id)
    assert queued(conn)[-2:] == [[3], [4]]


def test_update_of_other_columns_enqueues_nothing(conn, docs):
    conn.execute("DELETE FROM fern.queue")
    conn.execute("UPDATE docs SET views = views + 1")
    conn.execute("UPDATE docs SET body = body")  # a source column, but unchanged
    assert queued(conn) == []
    conn.execute("UPDATE docs SET body = 'new' WHERE id = 2")
    conn.execute("UPDATE docs SET title = NULL WHERE id = 1")
    assert queued(conn) == [[2], [1]]


def test_rolled_back_writes_leave_nothing(conn, docs):
    conn.execute("DELETE FROM fern.queue")
    with pytest.raises(RuntimeError):
        with conn.transaction():
            conn.execute("INSERT INTO docs VALUES (10, 'x', 'y', 0)")
            conn.execute("UPDATE docs SET body = 'z' WHERE id = 1")
            raise RuntimeError("roll back")
    assert queued(conn) == []


def test_queue_state_never_touches_user_table(conn, docs):
    cols = [r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'docs'::regclass AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum")]
    assert cols == ["id", "title", "body", "views", "embedding", "embedding_sparse"]


def test_split_mode_delete_and_truncate_remove_chunks(conn, fern):
    conn.execute("CREATE TABLE notes (a int, b text, body text, PRIMARY KEY (a, b))")
    v = create_vectorizer(conn, "notes", ["body"], client=fern, chunking="split",
                          chunk_tokens=32, chunk_overlap=4)
    chunks = v.chunk_table
    assert chunks == "notes_embedding_chunks"
    conn.execute("INSERT INTO notes VALUES (1, 'x', 'one'), (2, 'y', 'two')")
    # Chunk rows as a worker would write them (the worker is tested elsewhere).
    conn.execute("INSERT INTO notes_embedding_chunks SELECT a, b, 0, body, "
                 "array_fill(0.1, ARRAY[384])::vector FROM notes")
    conn.execute("DELETE FROM notes WHERE a = 1")
    assert conn.execute("SELECT a FROM notes_embedding_chunks").fetchall() == [(2,)]
    conn.execute("UPDATE notes SET a = 3 WHERE a = 2")  # key change: old chunks go
    assert conn.execute("SELECT count(*) FROM notes_embedding_chunks").fetchone() == (0,)
    assert queued(conn)[-1] == [3, "y"]
    conn.execute("INSERT INTO notes_embedding_chunks VALUES (3, 'y', 0, 'two', "
                 "array_fill(0.1, ARRAY[384])::vector)")
    conn.execute("TRUNCATE notes")
    assert conn.execute("SELECT count(*) FROM notes_embedding_chunks").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM fern.queue WHERE vectorizer_id = %s",
                        (v.id,)).fetchone() == (0,)


def test_non_owner_role_can_write_and_enqueue(conn, docs, pg_db):
    conn.execute("CREATE ROLE app_writer LOGIN")
    conn.execute("GRANT INSERT, UPDATE ON docs TO app_writer")
    with psycopg.connect(pg_db.replace("user=postgres", "user=app_writer"), autocommit=True) as app:
        app.execute("INSERT INTO docs (id, title, body) VALUES (7, 'a', 'b')")
    conn.execute("DROP OWNED BY app_writer")
    conn.execute("DROP ROLE app_writer")
    assert queued(conn)[-1] == [7]


def test_user_errors_name_the_input(conn, fern):
    conn.execute("CREATE TABLE nokey (body text)")
    with pytest.raises(VectorizerError, match="primary key"):
        create_vectorizer(conn, "nokey", ["body"], client=fern)
    conn.execute("CREATE TABLE k (id int PRIMARY KEY, body text)")
    with pytest.raises(VectorizerError, match="'missing'"):
        create_vectorizer(conn, "k", "{missing}", client=fern)
    with pytest.raises(VectorizerError, match="does not exist"):
        create_vectorizer(conn, "nope", ["body"], client=fern)
    create_vectorizer(conn, "k", ["body"], client=fern)
    with pytest.raises(VectorizerError, match="already has a vectorizer"):
        create_vectorizer(conn, "k", ["body"], client=fern)
    # Nothing half-made by the failures: one vectorizer, its triggers, no stray columns.
    assert conn.execute("SELECT count(*) FROM fern.vectorizers").fetchone() == (1,)


def test_drop_vectorizer_removes_triggers_and_queue(conn, docs):
    drop_vectorizer(conn, "docs", drop_column=True)
    conn.execute("INSERT INTO docs VALUES (5, 'a', 'b', 0)")
    assert queued(conn) == []
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'docs'::regclass "
                        "AND NOT tgisinternal").fetchone() == (0,)
