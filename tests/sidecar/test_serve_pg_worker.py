"""`fern serve --pg-worker-dsn`: the vectorizer worker runs inside the sidecar process and fills vectors."""

from __future__ import annotations

import time

import numpy as np
import pytest

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def pg():
    from adapters.postgres.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as server:
        yield server


def test_worker_started_by_fern_serve_embeds_inserted_rows(pg, sidecar_factory, client):
    from adapters.postgres.installer import install
    from adapters.postgres.vectorizer import create_vectorizer

    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        install(conn)
        conn.execute("CREATE TABLE notes (id int PRIMARY KEY, body text NOT NULL)")
        create_vectorizer(conn, "notes", ["body"], client=client)
        process = sidecar_factory("--pg-worker-dsn", pg.dsn)
        texts = {1: "the sidecar embeds this row", 2: "and this one", 3: "a third note"}
        for key, body in texts.items():
            conn.execute("INSERT INTO notes VALUES (%s, %s)", (key, body))
        deadline = time.monotonic() + 60
        rows = []
        while time.monotonic() < deadline:
            rows = conn.execute("SELECT id, embedding::text FROM notes WHERE embedding IS NOT NULL "
                                "ORDER BY id").fetchall()
            if len(rows) == len(texts):
                break
            time.sleep(0.1)
    assert [r[0] for r in rows] == [1, 2, 3], process.log()
    got = np.array([[float(x) for x in r[1].strip("[]").split(",")] for r in rows])
    expected = client.embed(list(texts.values())).vectors
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.99999
    assert process.terminate() == 0  # the worker stops with the sidecar's drain
    assert "fern: stopped" in process.log()
