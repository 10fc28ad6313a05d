"""`fern demo`'s Postgres part, and the `fern pg` verbs run as a user would run them."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg
from pg_helpers import cosines, fetch_vectors

from adapters.postgres import demo


def test_demo_runs_end_to_end(pg_target, capsys):
    demo.run(pg_target)
    out = capsys.readouterr().out
    assert out.count("vector readable") == len(demo.ARTICLES)
    assert "-> 0 row(s) queued" in out
    assert "re-embedded" in out
    assert "QX-7" in out.split("Hybrid search")[1]
    assert "pending 0, in flight 0, failed 0" in out


def fern_pg(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "sidecar.cli", "pg", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_cli_vectorize_worker_status(pg_db, pg_target, fern):
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE posts (id int PRIMARY KEY, title text, body text)")
        conn.execute("INSERT INTO posts SELECT g, 'title ' || g, 'body ' || g "
                     "FROM generate_series(1, 40) g")
    out = fern_pg("vectorize", "--dsn", pg_db, "--target", pg_target, "posts",
                  "--template", "{title}: {body}", "--hybrid")
    assert "40 row(s) queued" in out.stdout
    st = json.loads(fern_pg("status", "--dsn", pg_db, "--json").stdout)
    assert [(s["pending"], s["in_flight"], s["failed"]) for s in st] == [(40, 0, 0)]
    worker = fern_pg("worker", "--dsn", pg_db, "--target", pg_target, "--once", "--progress", "on")
    assert "rows/s" in worker.stderr and "40 rows" in worker.stderr
    st = json.loads(fern_pg("status", "--dsn", pg_db, "--json").stdout)
    assert [(s["pending"], s["in_flight"], s["failed"]) for s in st] == [(0, 0, 0)]
    with psycopg.connect(pg_db) as conn:
        from pgvector.psycopg import register_vector

        register_vector(conn)
        ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM posts ORDER BY id")
    ref = fern.embed([f"title {i}: body {i}" for i in ids], prompt="passage").vectors
    assert len(ids) == 40 and cosines(vecs, ref).min() >= 0.99999
    table = fern_pg("status", "--dsn", pg_db).stdout
    assert "public.posts.embedding" in table


def test_worker_on_a_database_without_the_schema_says_what_to_do(pg_db, pg_target):
    out = subprocess.run([sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", pg_db,
                          "--target", pg_target, "--once"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "fern pg install" in out.stderr


def test_worker_inside_fern_serve(pg_db, sidecar_factory):
    """`fern serve --pg-worker-dsn DSN` runs the worker beside the sidecar."""
    import time

    from sidecar.client import FernClient

    from adapters.postgres.installer import install
    from adapters.postgres.vectorizer import create_vectorizer

    with psycopg.connect(pg_db, autocommit=True) as conn:
        install(conn)
        conn.execute("CREATE TABLE tips (id int PRIMARY KEY, body text)")
        side = sidecar_factory("--pg-worker-dsn", pg_db)
        with FernClient(side.target) as fern:
            create_vectorizer(conn, "tips", ["body"], client=fern)
            conn.execute("INSERT INTO tips VALUES (1, 'water the ferns on Sundays')")
            deadline = time.monotonic() + 60
            while conn.execute("SELECT embedding IS NULL FROM tips").fetchone()[0]:
                assert time.monotonic() < deadline, "the sidecar's worker wrote no vector"
                time.sleep(0.05)
            from pgvector.psycopg import register_vector

            register_vector(conn)
            _, vec = fetch_vectors(conn, "SELECT id, embedding FROM tips")
            ref = fern.embed(["water the ferns on Sundays"], prompt="passage").vectors
        assert cosines(vec, ref)[0] >= 0.99999
