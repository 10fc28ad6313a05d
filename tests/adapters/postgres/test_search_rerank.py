"""search(..., rerank=N) on the real embedded PostgreSQL: the hybrid ranking's best N rescored by a reranker on the sidecar."""

from __future__ import annotations

import pytest
from pg_helpers import run_worker

from adapters.postgres.search import search
from adapters.postgres.vectorizer import create_vectorizer
from sidecar.client import FernClient


@pytest.fixture
def corpus(conn, pg_db, rerank_sidecar):
    conn.execute("CREATE TABLE kb (name text PRIMARY KEY, title text, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO kb (name, title, body) VALUES (%s, %s, %s)",
                        [(name, name.upper(), body) for name, body in rerank_sidecar.corpus.items()])
    with FernClient(rerank_sidecar.target, timeout=120) as client:
        create_vectorizer(conn, "kb", "{title}: {body}", client=client, hybrid=True)
    run_worker(pg_db, rerank_sidecar.target)
    return conn


def test_rerank_reorders_the_hybrid_top_n_by_the_rerankers_scores(corpus, rerank_sidecar):
    query = rerank_sidecar.query
    with FernClient(rerank_sidecar.target, timeout=120) as client:
        first = search(corpus, "kb", query, 6, client=client)
        hits = search(corpus, "kb", query, 3, client=client, rerank=6)
        # The reference: the same six rows' rendered text reranked directly over gRPC.
        texts = [f"{h.row['title']}: {h.row['body']}" for h in first]
        direct = client.rerank(query, texts, model=rerank_sidecar.model)
    assert len(hits) == 3
    assert [h.row["name"] for h in hits] == [first[r.index].row["name"] for r in direct.results[:3]]
    assert [h.rerank_score for h in hits] == pytest.approx([r.score for r in direct.results[:3]], abs=1e-6)
    assert all(0.0 < h.rerank_score < 1.0 for h in hits)
    # The rows are the table's columns only; the first stage's ranks and scores are kept.
    by_name = {h.row["name"]: h for h in first}
    for h in hits:
        assert set(h.row) == {"name", "title", "body"}
        assert (h.score, h.vector_rank, h.text_rank) == (by_name[h.row["name"]].score,
                                                         by_name[h.row["name"]].vector_rank,
                                                         by_name[h.row["name"]].text_rank)


def test_rerank_on_plain_vector_search_and_its_bounds(corpus, rerank_sidecar):
    query = rerank_sidecar.query
    with FernClient(rerank_sidecar.target, timeout=120) as client:
        hits = search(corpus, "kb", "a kitten in the sun", 2, hybrid=False, client=client, rerank=4)
        assert len(hits) == 2 and all(h.rerank_score is not None for h in hits)
        assert hits[0].rerank_score >= hits[1].rerank_score
        with pytest.raises(ValueError, match=r"rerank must be at least k \(3\)"):
            search(corpus, "kb", query, 3, client=client, rerank=2)
        from sidecar.client import FernError

        with pytest.raises(FernError, match="is an embedding model"):
            search(corpus, "kb", query, 3, client=client, rerank=4, rerank_model="all-MiniLM-L6-v2")
