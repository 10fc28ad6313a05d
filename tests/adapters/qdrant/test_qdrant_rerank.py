"""search(..., rerank_text=...) on Qdrant's local mode: the first stage's best points rescored by a cross-encoder on the sidecar."""

from __future__ import annotations

import asyncio

import pytest

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from sidecar.client import FernClient, FernError

TEMPLATE = "{title}: {body}"


def ingested(client: FernQdrantClient, corpus: dict[str, str]) -> FernQdrantClient:
    client.setup_collection("kb")
    client.ingest("kb", [{"name": n, "title": n.upper(), "body": b} for n, b in corpus.items()],
                  text=TEMPLATE, id="name")
    return client


@pytest.fixture
def qc(rerank_sidecar):
    with FernClient(rerank_sidecar.target, timeout=120) as fern:
        client = ingested(FernQdrantClient(":memory:", fern=fern), rerank_sidecar.corpus)
        yield client
        client.close()


def test_rerank_reorders_the_hybrid_top_n_by_the_rerankers_scores(qc, rerank_sidecar):
    first = qc.search("kb", rerank_sidecar.query, k=6)
    hits = qc.search("kb", rerank_sidecar.query, k=3, rerank_text=TEMPLATE, rerank_top=6)
    # The reference: the same six points' text reranked directly over gRPC.
    texts = [TEMPLATE.format(**p.payload) for p in first]
    direct = qc.fern.rerank(rerank_sidecar.query, texts, model=rerank_sidecar.model)
    assert [h.id for h in hits] == [first[r.index].id for r in direct.results[:3]]
    assert [h.id for h in hits] != [p.id for p in first[:3]]  # the reranker, not the fusion, ordered them
    assert [h.score for h in hits] == pytest.approx([r.score for r in direct.results[:3]], abs=1e-6)
    assert all(0.0 < h.score < 1.0 for h in hits)
    assert all(h.payload == next(p.payload for p in first if p.id == h.id) for h in hits)


def test_rerank_text_may_be_a_field_or_a_callable_and_payloads_are_as_asked(qc):
    by_field = qc.search("kb", "a kitten in the sun", k=2, hybrid=False, rerank_text="body", rerank_top=5,
                         with_payload=["name"])
    by_callable = qc.search("kb", "a kitten in the sun", k=2, hybrid=False, rerank_text=lambda p: p["body"],
                            rerank_top=5, with_payload=False)
    assert [h.id for h in by_field] == [h.id for h in by_callable]
    assert by_field[0].score >= by_field[1].score
    assert all(set(h.payload) == {"name"} for h in by_field)
    assert all(h.payload is None for h in by_callable)


def test_points_without_text_follow_the_scored_ones(qc, rerank_sidecar):
    first = qc.search("kb", rerank_sidecar.query, k=8, hybrid=False)
    silent = first[0].id  # the dense search's best point loses its text
    qc.overwrite_payload("kb", payload={"name": "laptop-without-text"}, points=[silent])
    hits = qc.search("kb", rerank_sidecar.query, k=8, hybrid=False, rerank_text="body", rerank_top=8)
    assert hits[-1].id == silent and hits[-1].score == first[0].score  # its first-stage score
    assert sorted(h.score for h in hits[:-1]) == [h.score for h in reversed(hits[:-1])]


def test_rerank_errors_name_their_input(qc, rerank_sidecar):
    with pytest.raises(ValueError, match=r"rerank_top must be at least k \(3\)"):
        qc.search("kb", rerank_sidecar.query, k=3, rerank_text="body", rerank_top=2)
    with pytest.raises(ValueError, match="give rerank_text too"):
        qc.search("kb", rerank_sidecar.query, k=3, rerank_top=5)
    with pytest.raises(ValueError, match=r"rerank_text 'abstract'.*no candidate's payload has 'abstract'"):
        qc.search("kb", rerank_sidecar.query, k=3, rerank_text="abstract")
    with pytest.raises(FernError, match="is an embedding model"):
        qc.search("kb", rerank_sidecar.query, k=3, rerank_text="body", rerank_model="all-MiniLM-L6-v2")


def test_the_async_client_reranks_as_the_sync_one(rerank_sidecar, tmp_path):
    path = str(tmp_path / "qdrant")
    sync = ingested(FernQdrantClient(path=path, fern=rerank_sidecar.target), rerank_sidecar.corpus)
    want = sync.search("kb", rerank_sidecar.query, k=3, rerank_text=TEMPLATE, rerank_top=6)
    sync.close()  # local mode on a path: one client at a time

    async def run():
        client = AsyncFernQdrantClient(path=path, fern=rerank_sidecar.target)
        try:
            return await client.search("kb", rerank_sidecar.query, k=3, rerank_text=TEMPLATE, rerank_top=6)
        finally:
            await client.close()

    got = asyncio.run(run())
    assert [h.id for h in got] == [h.id for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-6)
