"""search(..., rerank_text=...) on Qdrant's local mode: the first stage's best points rescored by a cross-encoder on the sidecar."""

from __future__ import annotations

import asyncio

import pytest
import torch

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir
from sidecar.client import FernClient, FernError

RERANKER = "qdrant-reranker"
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
TEMPLATE = "{title}: {body}"


@pytest.fixture(scope="module")
def rerank_target(sidecar_factory, tmp_path_factory) -> str:
    """A sidecar serving the bundled embedder (default) and a cross-encoder with random weights."""
    torch.manual_seed(7)
    hf = reranker_model(TINY_RERANKERS["bert"]).eval()
    randomize_weights(hf, 7)
    path = save_reranker_dir(hf, tmp_path_factory.mktemp("qdrant-rerank") / RERANKER)
    process = sidecar_factory("--model", "default", "--model", f"{RERANKER}={path}")
    yield process.target
    process.stop()


def ingested(client: FernQdrantClient) -> FernQdrantClient:
    client.setup_collection("kb")
    client.ingest("kb", [{"name": n, "title": n.upper(), "body": b} for n, b in CORPUS.items()],
                  text=TEMPLATE, id="name")
    return client


@pytest.fixture
def qc(rerank_target):
    with FernClient(rerank_target, timeout=120) as fern:
        client = ingested(FernQdrantClient(":memory:", fern=fern))
        yield client
        client.close()


def test_rerank_reorders_the_hybrid_top_n_by_the_rerankers_scores(qc):
    first = qc.search("kb", QUERY, k=6)
    hits = qc.search("kb", QUERY, k=3, rerank_text=TEMPLATE, rerank_top=6)
    # The reference: the same six points' text reranked directly over gRPC.
    texts = [TEMPLATE.format(**p.payload) for p in first]
    direct = qc.fern.rerank(QUERY, texts, model=RERANKER)
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


def test_points_without_text_follow_the_scored_ones(qc):
    first = qc.search("kb", QUERY, k=8, hybrid=False)
    silent = first[0].id  # the dense search's best point loses its text
    qc.overwrite_payload("kb", payload={"name": "laptop-without-text"}, points=[silent])
    hits = qc.search("kb", QUERY, k=8, hybrid=False, rerank_text="body", rerank_top=8)
    assert hits[-1].id == silent and hits[-1].score == first[0].score  # its first-stage score
    assert sorted(h.score for h in hits[:-1]) == [h.score for h in reversed(hits[:-1])]


def test_rerank_errors_name_their_input(qc):
    with pytest.raises(ValueError, match=r"rerank_top must be at least k \(3\)"):
        qc.search("kb", QUERY, k=3, rerank_text="body", rerank_top=2)
    with pytest.raises(ValueError, match="give rerank_text too"):
        qc.search("kb", QUERY, k=3, rerank_top=5)
    with pytest.raises(ValueError, match=r"rerank_text 'abstract'.*no candidate's payload has 'abstract'"):
        qc.search("kb", QUERY, k=3, rerank_text="abstract")
    with pytest.raises(FernError, match="is an embedding model"):
        qc.search("kb", QUERY, k=3, rerank_text="body", rerank_model="all-MiniLM-L6-v2")


def test_the_async_client_reranks_as_the_sync_one(rerank_target, tmp_path):
    path = str(tmp_path / "qdrant")
    sync = ingested(FernQdrantClient(path=path, fern=rerank_target))
    want = sync.search("kb", QUERY, k=3, rerank_text=TEMPLATE, rerank_top=6)
    sync.close()  # local mode on a path: one client at a time

    async def run():
        client = AsyncFernQdrantClient(path=path, fern=rerank_target)
        try:
            return await client.search("kb", QUERY, k=3, rerank_text=TEMPLATE, rerank_top=6)
        finally:
            await client.close()

    got = asyncio.run(run())
    assert [h.id for h in got] == [h.id for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-6)
