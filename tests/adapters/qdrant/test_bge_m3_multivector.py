"""BGE-M3 in Qdrant local mode: a MaxSim multi-vector beside dense and learned sparse, filled by ingest, reranking search."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from qdrant_client import QdrantClient, models

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.ingest import point_id
from sidecar.client import AsyncFernClient, FernClient
from tests.bge_m3_checkpoint import build_bge_m3

CORPUS = [
    {"id": f"doc-{i}", "text": text} for i, text in enumerate([
        "the quick brown fox jumps over the lazy dog",
        "vector search in qdrant with late interaction",
        "a database of dense and sparse embedding vectors",
        "hello world, what is the capital of france?",
        "paris is the capital city of france",
        "music and the river in the city",
        "token graph memory for the retrieval engine",
        "fast online queries and batch ingest lanes",
        "postgres table rows and an index for search",
        "apple and ocean",
    ])]
QUERY = "which city is the capital of france"


@pytest.fixture(scope="module")
def m3_target(sidecar_factory, tmp_path_factory):
    checkpoint = build_bge_m3(tmp_path_factory.mktemp("m3-qdrant") / "bge-m3", seed=31)
    process = sidecar_factory("--model", f"bge-m3={checkpoint.path}", "--model", "default")
    yield process.target
    process.stop()


@pytest.fixture
def m3(m3_target):
    with FernClient(m3_target, timeout=120) as fern:
        client = FernQdrantClient(":memory:", fern=fern)
        yield client
        client.close()


def maxsim(query: np.ndarray, doc: np.ndarray) -> float:
    """ColBERT's late interaction: each query vector's best cosine over the document's, summed."""
    return float((query @ doc.T).max(axis=1).sum())


def test_setup_collection_adds_a_maxsim_multivector_and_leaves_learned_weights_without_idf(m3) -> None:
    layout = m3.setup_collection("m3", multivector=True)
    assert (layout.model, layout.dense, layout.sparse, layout.multivector) == ("bge-m3", "dense", "sparse", "colbert")
    config = m3.get_collection("m3").config
    colbert = config.params.vectors["colbert"]
    assert colbert.size == 64
    assert colbert.multivector_config.comparator == models.MultiVectorComparator.MAX_SIM
    assert config.params.vectors["dense"].multivector_config is None
    assert config.params.sparse_vectors["sparse"].modifier in (None, models.Modifier.NONE)
    assert m3.setup_collection("m3", multivector=True) == layout  # checked, left as is
    m3.create_collection("plain", vectors_config={"dense": models.VectorParams(size=64, distance=models.Distance.COSINE)},
                         sparse_vectors_config={"sparse": models.SparseVectorParams()})
    with pytest.raises(ValueError, match="'plain' exists without a multi-vector named 'colbert'"):
        m3.setup_collection("plain", multivector=True)


def test_a_model_without_a_colbert_head_gets_no_multivector(m3) -> None:
    with pytest.raises(ValueError, match="model 'all-MiniLM-L6-v2' has no multi-vector"):
        m3.setup_collection("minilm", "all-MiniLM-L6-v2", multivector=True)
    m3.setup_collection("minilm", "all-MiniLM-L6-v2")
    with pytest.raises(ValueError, match="'minilm' has no multi-vector to rerank by"):
        m3.search("minilm", "cars", rerank=True)


def test_ingest_fills_all_three_vectors(m3) -> None:
    m3.setup_collection("m3", multivector=True)
    assert m3.ingest("m3", CORPUS, batch_size=4, progress=False).rows == len(CORPUS)
    texts = [r["text"] for r in CORPUS]
    reference = m3.fern.embed(texts, model="bge-m3", lane="batch", sparse=True, multivector=True)
    points = {p.id: p for p in m3.retrieve("m3", [point_id(r["id"]) for r in CORPUS], with_vectors=True)}
    for i, record in enumerate(CORPUS):
        vector = points[point_id(record["id"])].vector
        np.testing.assert_allclose(vector["colbert"], reference.multivectors[i], atol=1e-5)
        assert len(vector["colbert"]) == reference.token_counts[i] - 1
        np.testing.assert_allclose(vector["dense"], reference.vectors[i], atol=1e-5)
        assert vector["sparse"].indices == reference.sparse[i].indices.tolist()


def test_search_prefetches_dense_and_sparse_and_reranks_by_maxsim_in_one_query(m3, monkeypatch) -> None:
    m3.setup_collection("m3", multivector=True)
    m3.ingest("m3", CORPUS, batch_size=4, progress=False)
    calls = []
    real = QdrantClient.query_points

    def recording(self, *args, **kwargs):
        calls.append(inspect.signature(real).bind(self, *args, **kwargs).arguments)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "query_points", recording)
    hits = m3.search("m3", QUERY, k=5, prefetch_limit=len(CORPUS))
    assert len(calls) == 1
    prefetch = calls[0]["prefetch"]
    assert [p.using for p in prefetch] == ["dense", "sparse"] and calls[0]["using"] == "colbert"
    # The independent order: MaxSim of the query's multi-vector against every document's.
    texts = [r["text"] for r in CORPUS]
    docs = m3.fern.embed(texts, model="bge-m3", multivector=True).multivectors
    query = m3.fern.embed([QUERY], model="bge-m3", multivector=True).multivectors[0]
    scores = sorted(((maxsim(query, d), point_id(r["id"])) for d, r in zip(docs, CORPUS)), reverse=True)
    assert [h.id for h in hits] == [pid for _, pid in scores[:5]]
    np.testing.assert_allclose([h.score for h in hits], [s for s, _ in scores[:5]], atol=1e-4)
    # Without rerank: RRF fusion, a different kind of score; dense alone with hybrid=False.
    fused = m3.search("m3", QUERY, k=5, rerank=False)
    assert all(h.score <= 1.0 for h in fused)
    dense_rerank = m3.search("m3", QUERY, k=3, hybrid=False, prefetch_limit=len(CORPUS))
    assert [h.id for h in dense_rerank] == [pid for _, pid in scores[:3]]


def test_the_async_client_reranks_the_same_way(m3_target, tmp_path) -> None:
    path = str(tmp_path / "qdrant")
    with FernClient(m3_target, timeout=120) as fern:
        setup = FernQdrantClient(path=path, fern=fern)
        setup.setup_collection("m3", multivector=True)
        setup.ingest("m3", CORPUS, progress=False)
        blocking = [h.id for h in setup.search("m3", QUERY, k=4, prefetch_limit=len(CORPUS))]
        setup.close()

    async def scenario():
        fern_async = AsyncFernClient(m3_target)
        client = AsyncFernQdrantClient(path=path, fern=fern_async)
        hits = await client.search("m3", QUERY, k=4, prefetch_limit=len(CORPUS))
        await client.close()
        await fern_async.close()
        return hits

    assert [h.id for h in asyncio.run(scenario())] == blocking


def test_the_bge_m3_doc_runs_as_written(m3_target) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "bge-m3.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 2
    for code in blocks:
        scope: dict = {}
        exec(compile(code.replace("127.0.0.1:50051", m3_target), "docs/bge-m3.md", "exec"), scope)
        if "out" in scope:
            out = scope["out"]
            assert out.multivectors[0].shape == (out.token_counts[0] - 1, 64) and len(out.sparse[0].indices)
        else:
            assert scope["hits"] and scope["hits"][0].payload["id"] == 1
            scope["qc"].close()


def test_documents_can_ask_for_the_multivector(m3) -> None:
    m3.setup_collection("m3", multivector=True)
    model = "fern/bge-m3"
    m3.upsert("m3", [models.PointStruct(id=i, payload=r, vector={
        "dense": models.Document(text=r["text"], model=model),
        "sparse": models.Document(text=r["text"], model=model, options={"sparse": True}),
        "colbert": models.Document(text=r["text"], model=model, options={"multivector": True})})
        for i, r in enumerate(CORPUS)])
    stored = m3.retrieve("m3", [3], with_vectors=True)[0].vector
    reference = m3.fern.embed([CORPUS[3]["text"]], model="bge-m3", sparse=True, multivector=True)
    np.testing.assert_allclose(stored["colbert"], reference.multivectors[0], atol=1e-5)
    assert stored["sparse"].indices == reference.sparse[0].indices.tolist()
    by_doc = m3.query_points("m3", query=models.Document(text=QUERY, model=model, options={"multivector": True}),
                             using="colbert", limit=3).points
    searched = m3.search("m3", QUERY, k=3, prefetch_limit=100)
    assert [CORPUS[p.id]["id"] for p in by_doc] == [h.payload["id"] for h in searched]
    with pytest.raises(ValueError, match="options sparse and multivector ask for two vectors"):
        m3.query_points("m3", query=models.Document(text=QUERY, model=model,
                                                    options={"multivector": True, "sparse": True}), using="colbert")
