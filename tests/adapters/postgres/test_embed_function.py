"""`fern.embed()` / `fern.embed_many()` in the real PostgreSQL 18, through dblink to a real `fern serve --pg-port`.

Vectors are held to the gRPC client's for the same text; the synchronous contract (a write
through fern.embed fails, naming Fern, when the sidecar is down, while a queue-based
vectorizer keeps accepting writes) and the persistent connection (reused, and reopened
after a sidecar restart) are shown on the real server.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import psycopg
import pytest
from pg_helpers import free_port
from psycopg import sql
from psycopg.conninfo import make_conninfo

from adapters.postgres import embed_function, installer
from sidecar.client import FernClient

TOKEN = "sql-function-secret"


@pytest.fixture(scope="module")
def sidecar(sidecar_process_class):
    with sidecar_process_class(["--token", TOKEN, "--pg-port", "0"]) as process:
        yield process


@pytest.fixture(scope="module")
def grpc_client(sidecar):
    with FernClient(sidecar.target, token=TOKEN, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def db(pg_dsn, sidecar):
    """A database of this module's own with fern.embed installed against the module's sidecar."""
    name = f"embedfn_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(pg_dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        installer.install(conn)
        embed_function.install(conn, endpoint=f"127.0.0.1:{sidecar.pg_port}", password=TOKEN)
    yield dsn
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def conn(db):
    with psycopg.connect(db, autocommit=True) as c:
        yield c


def as_array(value) -> np.ndarray:
    """A pgvector value as psycopg returns it without the pgvector adapter: '[1,2,...]'."""
    text = value if isinstance(value, str) else str(value)
    return np.array([float(x) for x in text.strip("[]").split(",")], dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def pgvector_text(v: np.ndarray) -> str:
    return "[" + ",".join(f"{x:.9g}" for x in v.tolist()) + "]"


def new_role(conn: psycopg.Connection) -> str:
    role = f"app_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(sql.Identifier(role)))
    return role


def test_embed_equals_the_grpc_clients_vector(conn, grpc_client):
    text = "pgvector meets a GPU sidecar, called from plain SQL"
    (got,), = conn.execute("SELECT fern.embed(%s)::text", [text]).fetchall()
    assert cosine(as_array(got), grpc_client.embed([text]).vectors[0]) >= 0.99999
    assert conn.execute("SELECT fern.embed(NULL) IS NULL").fetchone()[0]
    assert conn.execute("SELECT vector_dims(fern.embed('x'))").fetchone()[0] == 384


def test_embed_many_keeps_order_and_nulls(conn, grpc_client):
    texts = ["one", None, "three 'quoted'", "four\\backslash"]
    rows = conn.execute("SELECT ord, embedding::text FROM fern.embed_many(%s)", [texts]).fetchall()
    assert [r[0] for r in rows] == [1, 2, 3, 4] and rows[1][1] is None
    want = grpc_client.embed([t for t in texts if t is not None]).vectors
    for (_, got), w in zip([r for r in rows if r[1] is not None], want, strict=True):
        assert cosine(as_array(got), w) >= 0.99999
    assert conn.execute("SELECT count(*) FROM fern.embed_many('{}'::text[])").fetchone()[0] == 0


def test_options_and_model_arguments(conn, grpc_client):
    model = grpc_client.list_models()[0].name
    (got,), = conn.execute("SELECT fern.embed(%s, %s, 'dimensions=128,prompt=query')::text",
                           ["short query", model]).fetchall()
    want = grpc_client.embed(["short query"], dimensions=128, prompt="query").vectors[0]
    assert as_array(got).shape == (128,) and cosine(as_array(got), want) >= 0.99999
    with pytest.raises(psycopg.errors.UndefinedObject, match="Fern: .*no-such-model"):
        conn.execute("SELECT fern.embed('x', 'no-such-model')")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"Fern: texts\[0\]: empty text"):
        conn.execute("SELECT fern.embed('')")


def test_order_by_fern_embed_returns_the_rows_of_python_search(conn, db, grpc_client):
    """`ORDER BY emb <=> fern.embed($1) LIMIT 10` (via HNSW) = the adapter's `search(..., hybrid=False)`."""
    from adapters.postgres.search import search
    from adapters.postgres.vectorizer import create_vectorizer
    from adapters.postgres.worker import Worker, WorkerConfig

    topics = ["databases", "gardening", "astronomy", "cooking", "music", "football", "law",
              "medicine", "poetry", "trains"]
    texts = [f"A note about {topics[i % 10]}, number {i}, with detail {i * 7 % 13}" for i in range(200)]
    conn.execute("CREATE TABLE notes (id int PRIMARY KEY, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO notes VALUES (%s, %s)", list(enumerate(texts)))
    create_vectorizer(conn, "notes", ["body"], client=grpc_client)
    worker = Worker(WorkerConfig(dsn=db), client=grpc_client)
    worker.run(until_empty=True, timeout=120)
    assert conn.execute("SELECT count(embedding) FROM notes").fetchone()[0] == 200

    query = "stars, planets and telescopes"
    want = [hit.row["id"] for hit in search(conn, "notes", query, 10, hybrid=False,
                                            client=grpc_client)]
    sql_query = ("SELECT id FROM notes ORDER BY embedding <=> fern.embed(%s, '', 'prompt=query') "
                 "LIMIT 10")
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql_query, [query]))
        got = [r[0] for r in conn.execute(sql_query, [query])]
    (hnsw,), = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'notes' "
                            "AND indexdef LIKE '%USING hnsw%'").fetchall()
    assert f"Index Scan using {hnsw} on notes" in plan        # fern.embed folded to a constant
    assert got == want
    assert {i % 10 for i in got} == {topics.index("astronomy")}


HOSTILE = [
    "'); DROP TABLE victims; --",
    "it's \\' \\\\ \" $$ $tag$ E'\\x00' U&'\\0000'",
    "Robert'); SELECT fern.embed('x'); --",
    "\\",
    "'",
    "%L %s %I",
    "日本語 😀 é\ttab\nnewline",
]


def test_hostile_texts_are_data_and_nothing_else_runs(conn, grpc_client):
    conn.execute("CREATE TABLE victims (id int)")
    conn.execute("INSERT INTO victims VALUES (1)")
    want = grpc_client.embed(HOSTILE).vectors
    for text, w in zip(HOSTILE, want):
        (got,), = conn.execute("SELECT fern.embed(%s)::text", [text]).fetchall()
        assert cosine(as_array(got), w) >= 0.99999, text
    rows = conn.execute("SELECT ord, embedding::text FROM fern.embed_many(%s)", [HOSTILE]).fetchall()
    for (_, got), w in zip(rows, want, strict=True):
        assert cosine(as_array(got), w) >= 0.99999
    assert conn.execute("SELECT count(*) FROM victims").fetchone()[0] == 1
    big = ("a megabyte of 'quotes' and \\backslashes\\ " * 30_000)[:1_000_000]
    (got,), = conn.execute("SELECT fern.embed(%s)::text", [big]).fetchall()
    assert cosine(as_array(got), grpc_client.embed([big]).vectors[0]) >= 0.99999
    with pytest.raises(psycopg.DataError):           # PostgreSQL text cannot hold NUL at all
        conn.execute("SELECT fern.embed(%s)", ["nul\x00byte"])
    assert conn.execute("SELECT vector_dims(fern.embed('still serving'))").fetchone()[0] == 384


def test_before_insert_trigger_fills_the_vector_for_a_non_superuser(conn, db, grpc_client):
    role = new_role(conn)
    conn.execute("CREATE TABLE articles (id int PRIMARY KEY, body text, emb vector(384))")
    conn.execute("""CREATE FUNCTION articles_embed() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN NEW.emb := fern.embed(NEW.body); RETURN NEW; END $$""")
    conn.execute("CREATE TRIGGER articles_embed BEFORE INSERT ON articles "
                 "FOR EACH ROW EXECUTE FUNCTION articles_embed()")
    conn.execute(sql.SQL("GRANT SELECT, INSERT ON articles TO {}").format(sql.Identifier(role)))
    with psycopg.connect(make_conninfo(db, user=role), autocommit=True) as app:
        assert not app.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
        app.execute("INSERT INTO articles (id, body) VALUES (1, 'written by an app role'), "
                    "(2, 'and a second row')")
        rows = app.execute("SELECT body, emb::text FROM articles ORDER BY id").fetchall()
        # The secret stays out of reach: no option shown, no direct use of the server.
        assert app.execute("SELECT umoptions FROM pg_user_mappings "
                           "WHERE srvname = 'fern_sidecar'").fetchall() in ([], [(None,)])
        with pytest.raises(psycopg.Error):
            app.execute("SELECT dblink_connect('mine', 'fern_sidecar')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute("SELECT * FROM fern._sidecar_query('SELECT * FROM embed_many(ARRAY[''x''])')")
    want = grpc_client.embed([b for b, _ in rows]).vectors
    for (_, got), w in zip(rows, want):
        assert cosine(as_array(got), w) >= 0.99999


def test_one_connection_per_session_is_reused(conn):
    """Many calls, one endpoint session: a setting made on it survives 20 more calls."""
    conn.execute("SELECT fern.embed('open it')")
    assert conn.execute("SELECT dblink_get_connections()").fetchone()[0] == ["fern_sidecar"]
    conn.execute("SELECT dblink_exec('fern_sidecar', 'SET application_name = ''marker''')")
    conn.execute("SELECT fern.embed(format('row %s', g)) FROM generate_series(1, 20) g")
    assert conn.execute("SELECT v FROM dblink('fern_sidecar', 'SHOW application_name') "
                        "AS r(v text)").fetchone() == ("marker",)


def test_statement_timeout_reaches_the_sidecar(conn):
    """dblink waits for an answer even after statement_timeout fires; the sidecar drops the work."""
    conn.execute("SET statement_timeout = '500ms'")
    started = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT count(*) FROM fern.embed_many(array(SELECT format('text %s: %s', g, "
                     "repeat('many words of text ', 60)) FROM generate_series(1, 1500) g))")
    assert time.monotonic() - started < 30              # ~150 s of CPU work without the deadline
    conn.execute("RESET statement_timeout")
    assert conn.execute("SELECT vector_dims(fern.embed('after the timeout'))").fetchone()[0] == 384


def test_sidecar_down_fails_the_synchronous_write_but_not_the_queue(sidecar_process_class, pg_db,
                                                                   grpc_client):
    """The synchronous contract, side by side with the vectorizer's; then a restart reconnects.

    Stopping the sidecar (SIGTERM, a drain) also ends the endpoint's open sessions.
    """
    from adapters.postgres.vectorizer import create_vectorizer

    port = free_port()
    args = ["--token", TOKEN, "--pg-port", str(port)]
    with psycopg.connect(pg_db, autocommit=True) as conn:
        installer.install(conn)
        embed_function.install(conn, endpoint=f"127.0.0.1:{port}", password=TOKEN)
        conn.execute("CREATE TABLE sync_docs (id int PRIMARY KEY, body text, emb vector(384))")
        conn.execute("""CREATE FUNCTION sync_embed() RETURNS trigger LANGUAGE plpgsql AS $$
                        BEGIN NEW.emb := fern.embed(NEW.body); RETURN NEW; END $$""")
        conn.execute("CREATE TRIGGER sync_embed BEFORE INSERT ON sync_docs "
                     "FOR EACH ROW EXECUTE FUNCTION sync_embed()")
        conn.execute("CREATE TABLE queued_docs (id int PRIMARY KEY, body text)")
        create_vectorizer(conn, "queued_docs", ["body"], client=grpc_client)

        with sidecar_process_class(args) as first:
            conn.execute("INSERT INTO sync_docs VALUES (1, 'while the sidecar is up')")
            direct = psycopg.connect(f"host=127.0.0.1 port={port} user=fern dbname=fern "
                                     f"password={TOKEN}", autocommit=True)
            assert first.terminate() == 0               # drain: open sessions are ended
        with pytest.raises(psycopg.OperationalError):
            direct.execute("SELECT embed('after the drain')")
        direct.close()
        # The session's dblink connection now points at a sidecar that is gone.
        with pytest.raises(psycopg.errors.ConnectionException) as info:
            conn.execute("INSERT INTO sync_docs VALUES (2, 'while the sidecar is down')")
        assert "Fern sidecar unreachable" in info.value.diag.message_primary
        with psycopg.connect(pg_db, autocommit=True) as fresh:  # a new session: connect fails
            with pytest.raises(psycopg.errors.ConnectionException, match="Fern sidecar unreachable"):
                fresh.execute("INSERT INTO sync_docs VALUES (3, 'new session, sidecar down')")
        conn.execute("INSERT INTO queued_docs VALUES (1, 'the queue takes it'), (2, 'and this')")
        assert conn.execute("SELECT count(*) FROM queued_docs").fetchone()[0] == 2
        assert conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0] >= 2
        assert conn.execute("SELECT id FROM sync_docs").fetchall() == [(1,)]

        with sidecar_process_class(args):                      # back on the same port: same session reconnects
            conn.execute("INSERT INTO sync_docs VALUES (4, 'after the restart')")
        assert conn.execute("SELECT id FROM sync_docs WHERE emb IS NOT NULL ORDER BY id").fetchall() \
            == [(1,), (4,)]


def test_install_is_idempotent_and_repoints_the_server(conn, sidecar):
    assert embed_function.install(conn, endpoint=f"127.0.0.1:{sidecar.pg_port}", password=TOKEN) == []
    options = conn.execute("SELECT srvoptions FROM pg_foreign_server "
                           "WHERE srvname = 'fern_sidecar'").fetchone()[0]
    assert f"port={sidecar.pg_port}" in options and not any("password" in o for o in options)
    with pytest.raises(ValueError, match="HOST:PORT"):
        embed_function.install(conn, endpoint="no-port", password=TOKEN)
    with pytest.raises(ValueError, match="password"):
        embed_function.install(conn, endpoint="127.0.0.1:5433", password="")
