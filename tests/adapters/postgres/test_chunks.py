"""Split chunking end to end: chunk rows with overlap, each vector the sidecar's for its text."""

from __future__ import annotations

import random

from pg_helpers import cosines, fetch_vectors, run_worker

from adapters.postgres.search import search
from adapters.postgres.vectorizer import create_vectorizer


def test_long_text_is_split_embedded_and_kept_in_sync(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE books (id int PRIMARY KEY, body text)")
    prose = " ".join(f"Chapter {i} tells how the lighthouse keeper counted {i * 7} gulls."
                     for i in range(60))
    conn.execute("INSERT INTO books VALUES (1, %s), (2, 'A short note about tea.')", (prose,))
    v = create_vectorizer(conn, "books", ["body"], client=fern, chunking="split",
                          chunk_tokens=64, chunk_overlap=16)
    run_worker(pg_db, pg_target)
    rows = conn.execute("SELECT id, chunk_index, chunk_text FROM books_embedding_chunks "
                        "ORDER BY id, chunk_index").fetchall()
    long_chunks = [r[2] for r in rows if r[0] == 1]
    assert len(long_chunks) > 5
    assert [r[1] for r in rows if r[0] == 1] == list(range(len(long_chunks)))
    assert [r[2] for r in rows if r[0] == 2] == ["A short note about tea."]
    for a, b in zip(long_chunks, long_chunks[1:]):
        assert b.split()[0] in a.split()[-12:]  # overlap: b starts inside a's tail
    assert long_chunks[0].startswith("Chapter 0") and long_chunks[-1].endswith("gulls.")
    _, vecs = fetch_vectors(conn, "SELECT chunk_text, embedding FROM books_embedding_chunks "
                                  "ORDER BY id, chunk_index")
    emb = fern.embed([r[2] for r in rows], prompt=v.prompt)
    assert cosines(vecs, emb.vectors).min() >= 0.99999
    hits = search(conn, "books", "lighthouse keeper and seagulls", 2, client=fern)
    assert [h.row["id"] for h in hits] == [1, 2]
    conn.execute("UPDATE books SET body = 'Now a short text about coffee.' WHERE id = 1")
    run_worker(pg_db, pg_target)
    assert conn.execute("SELECT chunk_text FROM books_embedding_chunks WHERE id = 1").fetchall() \
        == [("Now a short text about coffee.",)]


def test_chunks_the_sidecar_had_to_cut_are_split_again(conn, fern, pg_db, pg_target):
    # Long digit strings cost several tokens a "word": the word estimate undershoots, the
    # sidecar's token_counts catch it, and no chunk reaches the model's limit.
    rng = random.Random(5)
    text = " ".join(str(rng.randrange(10**11, 10**12)) for _ in range(400))
    conn.execute("CREATE TABLE nums (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO nums VALUES (1, %s)", (text,))
    limit = fern.model().max_tokens
    create_vectorizer(conn, "nums", ["body"], client=fern, chunking="split")
    run_worker(pg_db, pg_target)
    chunks = [r[0] for r in conn.execute(
        "SELECT chunk_text FROM nums_embedding_chunks ORDER BY chunk_index")]
    counts = fern.embed(chunks).token_counts
    assert max(counts) < limit
    assert set(" ".join(chunks).split()) == set(text.split())
