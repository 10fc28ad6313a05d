"""search(..., rerank=N) on the real embedded PostgreSQL: the hybrid ranking's best N rescored by a reranker on the sidecar."""

from __future__ import annotations

import pytest
import torch
from pg_helpers import run_worker

from adapters.postgres.search import search
from adapters.postgres.vectorizer import create_vectorizer
from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir
from sidecar.client import FernClient

RERANKER = "pg-reranker"
CORPUS = {
    "laptop": "My laptop will not turn on and the display stays dark after I press power.",
    "zorblax": "Zorblax is the codename of the new line of ceramic garden gnomes.",
    "cat": "The cat sat quietly on the warm windowsill all afternoon.",
    "garden": "Tomatoes need plenty of sunlight and regular watering to ripen.",
    "train": "The night train from Vienna to Venice crosses the Alps.",
    "screen": "A black screen at boot often means the graphics driver failed to load.",
    "battery": "Replace the battery if the computer shuts down right after it starts.",
    "music": "The orchestra rehearsed the symphony's final movement twice.",
}
QUERY = "computer won't boot, black screen (zorblax)"


@pytest.fixture(scope="module")
def rerank_target(sidecar_factory, tmp_path_factory) -> str:
    """A sidecar serving the bundled embedder (default) and a cross-encoder with random weights."""
    torch.manual_seed(5)
    hf = reranker_model(TINY_RERANKERS["bert"]).eval()
    randomize_weights(hf, 5)
    path = save_reranker_dir(hf, tmp_path_factory.mktemp("pg-rerank") / RERANKER)
    process = sidecar_factory("--model", "default", "--model", f"{RERANKER}={path}")
    yield process.target
    process.stop()


@pytest.fixture
def corpus(conn, pg_db, rerank_target):
    conn.execute("CREATE TABLE kb (name text PRIMARY KEY, title text, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO kb (name, title, body) VALUES (%s, %s, %s)",
                        [(name, name.upper(), body) for name, body in CORPUS.items()])
    with FernClient(rerank_target, timeout=120) as client:
        create_vectorizer(conn, "kb", "{title}: {body}", client=client, hybrid=True)
    run_worker(pg_db, rerank_target)
    return conn


def test_rerank_reorders_the_hybrid_top_n_by_the_rerankers_scores(corpus, rerank_target):
    with FernClient(rerank_target, timeout=120) as client:
        first = search(corpus, "kb", QUERY, 6, client=client)
        hits = search(corpus, "kb", QUERY, 3, client=client, rerank=6)
        # The reference: the same six rows' rendered text reranked directly over gRPC.
        texts = [f"{h.row['title']}: {h.row['body']}" for h in first]
        direct = client.rerank(QUERY, texts, model=RERANKER)
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


def test_rerank_on_plain_vector_search_and_its_bounds(corpus, rerank_target):
    with FernClient(rerank_target, timeout=120) as client:
        hits = search(corpus, "kb", "a kitten in the sun", 2, hybrid=False, client=client, rerank=4)
        assert len(hits) == 2 and all(h.rerank_score is not None for h in hits)
        assert hits[0].rerank_score >= hits[1].rerank_score
        with pytest.raises(ValueError, match=r"rerank must be at least k \(3\)"):
            search(corpus, "kb", QUERY, 3, client=client, rerank=2)
        from sidecar.client import FernError

        with pytest.raises(FernError, match="is an embedding model"):
            search(corpus, "kb", QUERY, 3, client=client, rerank=4, rerank_model="all-MiniLM-L6-v2")
