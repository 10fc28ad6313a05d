"""Privileges: no role can fire Fern's trigger functions on its own table, and the worker
runs as a role with only the grants `installer.grant_worker` gives."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "postgres"))
from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: E402,F401
from pg_helpers import cosines, fetch_vectors, run_worker  # noqa: E402

from adapters.postgres import embed_function  # noqa: E402
from adapters.postgres.installer import grant_worker  # noqa: E402
from adapters.postgres.vectorizer import create_vectorizer, refresh_triggers  # noqa: E402


def _role(conn: psycopg.Connection, prefix: str) -> str:
    """A LOGIN role that is not a superuser (roles are cluster-wide: a fresh name per test)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE").format(
        sql.Identifier(name)))
    return name


def _as(dsn: str, role: str) -> psycopg.Connection:
    return psycopg.connect(dsn.replace("user=postgres", f"user={role}"), autocommit=True)


@pytest.fixture
def victims(conn, fern):
    """After `fern pg install --sql-endpoint` (USAGE on schema fern for PUBLIC): a vectorizer
    with 200 queued rows, and a split vectorizer on another table with 30 chunk rows."""
    embed_function.install(conn, endpoint="127.0.0.1:9", password="not-used-here")
    conn.execute("CREATE TABLE victim (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO victim SELECT g, 'victim ' || g FROM generate_series(1, 200) g")
    queued = create_vectorizer(conn, "victim", ["body"], client=fern)
    conn.execute("CREATE TABLE longdocs (id int PRIMARY KEY, body text)")
    split = create_vectorizer(conn, "longdocs", ["body"], client=fern, chunking="split",
                              chunk_tokens=64)
    conn.execute(sql.SQL("INSERT INTO {} (id, chunk_index, chunk_text, embedding) "
                         "SELECT g, 0, 'c', array_fill(0.1::real, ARRAY[{}])::vector "
                         "FROM generate_series(1, 30) g").format(
        split.chunks, sql.Literal(split.dimensions)))
    mallory = _role(conn, "mallory")
    conn.execute(sql.SQL("CREATE SCHEMA mallory AUTHORIZATION {}").format(sql.Identifier(mallory)))
    return queued, split, mallory


def _counts(conn, queued, split) -> tuple[int, int]:
    q = conn.execute("SELECT count(*) FROM fern.queue WHERE vectorizer_id = %s",
                     (queued.id,)).fetchone()[0]
    c = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(split.chunks)).fetchone()[0]
    return q, c


ATTACKS = [("truncate", "AFTER TRUNCATE", "FOR EACH STATEMENT"),
           ("insert", "AFTER INSERT", "REFERENCING NEW TABLE AS fern_new FOR EACH STATEMENT"),
           ("delete", "AFTER DELETE", "REFERENCING OLD TABLE AS fern_old FOR EACH STATEMENT")]


@pytest.mark.parametrize("kind, event, clause", ATTACKS)
def test_a_role_cannot_attach_fern_trigger_functions_to_its_own_table(conn, pg_db, victims,
                                                                      kind, event, clause):
    queued, split, mallory = victims
    vid = split.id if kind == "delete" else queued.id
    with _as(pg_db, mallory) as m:
        m.execute("CREATE TABLE mallory.mine (id int PRIMARY KEY, body text)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            m.execute(sql.SQL("CREATE TRIGGER t {} ON mallory.mine {} EXECUTE FUNCTION {}()")
                      .format(sql.SQL(event), sql.SQL(clause),
                              sql.Identifier("fern", f"vectorizer_{vid}_{kind}")))
    assert _counts(conn, queued, split) == (200, 30)


@pytest.mark.parametrize("kind, event, clause", ATTACKS)
def test_a_fern_trigger_function_attached_elsewhere_refuses_to_run(conn, pg_db, victims,
                                                                   kind, event, clause):
    queued, split, mallory = victims
    vid = split.id if kind == "delete" else queued.id
    with _as(pg_db, mallory) as m:
        m.execute("CREATE TABLE mallory.mine (id int PRIMARY KEY, body text)")
        m.execute("INSERT INTO mallory.mine SELECT g, 'x' FROM generate_series(1, 30) g")
    # Attached the way the functions could be reached before they were revoked from PUBLIC.
    conn.execute(sql.SQL("CREATE TRIGGER t {} ON mallory.mine {} EXECUTE FUNCTION {}()").format(
        sql.SQL(event), sql.SQL(clause), sql.Identifier("fern", f"vectorizer_{vid}_{kind}")))
    fire = {"truncate": "TRUNCATE mallory.mine",
            "insert": "INSERT INTO mallory.mine SELECT g, 'x' FROM generate_series(100, 5099) g",
            "delete": "DELETE FROM mallory.mine"}[kind]
    with _as(pg_db, mallory) as m, pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
        m.execute(fire)
    assert f"not the table of vectorizer {vid}" in str(err.value)
    assert _counts(conn, queued, split) == (200, 30)
    # Regenerating the triggers (the installer does after an upgrade) drops such attachments.
    refresh_triggers(conn)
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'mallory.mine'::regclass"
                        ).fetchone() == (0,)
    assert _counts(conn, queued, split) == (200, 30)


def test_writers_without_fern_privileges_still_enqueue(conn, pg_db, victims):
    queued, split, _ = victims
    app = _role(conn, "app")
    conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON victim, longdocs "
                         "TO {}").format(sql.Identifier(app)))
    with _as(pg_db, app) as a:
        a.execute("INSERT INTO victim VALUES (1000, 'new')")
        a.execute("UPDATE victim SET body = 'changed' WHERE id = 1")
        a.execute("DELETE FROM longdocs")  # fires the split delete trigger: no rows, no chunks
        a.execute("INSERT INTO longdocs VALUES (1, 'doc')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            a.execute("SELECT count(*) FROM fern.queue")
    assert _counts(conn, queued, split)[0] == 202


def test_worker_embeds_as_a_login_role_with_only_the_documented_grants(conn, fern, pg_db,
                                                                       pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, title text, body text, secret text)")
    conn.execute("INSERT INTO items SELECT g, 'title ' || g, 'body ' || g, 's' "
                 "FROM generate_series(1, 40) g")
    v = create_vectorizer(conn, "items", "{title}: {body}", client=fern, hybrid=True)
    conn.execute("CREATE SCHEMA docs")
    conn.execute("CREATE TABLE docs.long (id text PRIMARY KEY, body text)")
    conn.execute("INSERT INTO docs.long SELECT 'd' || g, repeat('word ' || g || ' ', 80) "
                 "FROM generate_series(1, 5) g")
    s = create_vectorizer(conn, "docs.long", ["body"], client=fern, chunking="split",
                          chunk_tokens=64)
    worker_role = _role(conn, "fern_worker")
    statements = grant_worker(conn, worker_role)
    assert not any("ALL" in st or " TO PUBLIC" in st for st in statements)
    assert conn.execute("SELECT rolsuper, rolcreaterole, rolbypassrls FROM pg_roles "
                        "WHERE rolname = %s", (worker_role,)).fetchone() == (False, False, False)
    worker_dsn = pg_db.replace("user=postgres", f"user={worker_role}")
    worker = run_worker(worker_dsn, pg_target, timeout=120)
    assert worker.stats.vectorizers_parked == 0
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items ORDER BY id")
    assert len(ids) == 40
    ref = fern.embed([f"title {i}: body {i}" for i in ids], prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999
    assert conn.execute(sql.SQL("SELECT count(DISTINCT id), count(*) > 5 FROM {}").format(
        s.chunks)).fetchone() == (5, True)
    # Nothing beyond what the worker needs.
    with _as(pg_db, worker_role) as w:
        for denied in ("SELECT secret FROM items", "UPDATE items SET body = 'x'",
                       "DELETE FROM items", "INSERT INTO fern.queue (vectorizer_id, row_key) "
                       "VALUES (1, '[1]')", "DELETE FROM fern.vectorizers",
                       "CREATE TABLE public.mine (x int)"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                w.execute(denied)
