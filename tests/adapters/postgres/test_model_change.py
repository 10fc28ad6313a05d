"""Zero-downtime model change: a shadow column fills in the background, then swaps in atomically."""

from __future__ import annotations

import pytest
from pg_helpers import cosines, fetch_vectors, run_worker

from adapters.postgres.search import search
from adapters.postgres.status import status
from adapters.postgres.vectorizer import alter_vectorizer, create_vectorizer, list_vectorizers
from sidecar.client import FernClient


def attnum(conn, column: str) -> int | None:
    row = conn.execute("SELECT attnum FROM pg_attribute WHERE attrelid = 'docs'::regclass "
                       "AND attname = %s AND NOT attisdropped", (column,)).fetchone()
    return row[0] if row else None


@pytest.mark.slow
def test_model_change_fills_a_new_column_then_swaps(conn, pg_db, sidecar_factory):
    # Two names for the bundled weights: a real change of the served model name.
    side = sidecar_factory("--model", "mini-a=default", "--model", "mini-b=default")
    client = FernClient(side.target, timeout=120)
    conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO docs SELECT g, 'document number ' || g FROM generate_series(1, 300) g")
    create_vectorizer(conn, "docs", ["body"], client=client, model="mini-a", hybrid=True)
    run_worker(pg_db, side.target)
    old_col = attnum(conn, "embedding")

    shadow = alter_vectorizer(conn, "docs", model="mini-b", client=client)
    assert (shadow.target_column, shadow.backfilled, shadow.model) == ("embedding_next", 300, "mini-b")
    st = {s.vectorizer_id: s for s in status(conn)}
    assert st[shadow.id].replaces is not None and st[shadow.id].pending == 300
    # Searches keep working on the old column while the new one fills.
    before = search(conn, "docs", "document number 7", 3, client=client)
    assert before[0].row["id"] == 7
    # Writes during the change reach both columns.
    conn.execute("UPDATE docs SET body = 'a changed text about rivers' WHERE id = 1")
    conn.execute("INSERT INTO docs VALUES (1000, 'a new row about mountains')")

    run_worker(pg_db, side.target)
    (v,) = list_vectorizers(conn)
    assert (v.model, v.generation, v.target_column, v.replaces) == ("mini-b", 2, "embedding", None)
    assert attnum(conn, "embedding_next") is None
    assert attnum(conn, "embedding") not in (None, old_col)
    idx = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'docs' "
                       "AND indexdef LIKE '%hnsw%'").fetchall()
    assert idx == [("docs_embedding_hnsw",)]
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM docs ORDER BY id")
    texts = [r[0] for r in conn.execute("SELECT body FROM docs ORDER BY id")]
    assert len(ids) == 301
    ref = client.embed(texts, model="mini-b", prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999
    after = search(conn, "docs", "rivers", 1, client=client)
    assert after[0].row["id"] == 1
    assert conn.execute("SELECT count(*) FROM fern.queue").fetchone() == (0,)
    client.close()
