"""Collection setup from ListModels and text search: dense, and dense + sparse fused by RRF in one query."""

from __future__ import annotations

import inspect

import pytest
from qdrant_client import QdrantClient, models

from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.demo import CORPUS


def created_with(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Records the arguments of QdrantClient.create_collection (local mode drops quantization)."""
    calls = []
    real = QdrantClient.create_collection

    def recording(self, *args, **kwargs):
        calls.append(inspect.signature(real).bind(self, *args, **kwargs).arguments)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "create_collection", recording)
    return calls


def test_setup_collection_follows_list_models(qdrant, fern, collection_name, monkeypatch):
    info = fern.model()
    created = created_with(monkeypatch)
    layout = qdrant.setup_collection(collection_name, quantization="int8")
    assert (layout.model, layout.dense, layout.sparse) == (info.name, "dense", "sparse")
    config = qdrant.get_collection(collection_name).config
    dense = config.params.vectors["dense"]
    assert dense.size == info.dimensions == 384
    assert dense.distance == models.Distance.COSINE
    assert config.params.sparse_vectors["sparse"].modifier == models.Modifier.IDF
    quantization = created[0]["quantization_config"]
    assert quantization.scalar.type == models.ScalarType.INT8
    if config.quantization_config is not None:  # a server keeps it; local mode ignores it
        assert config.quantization_config == quantization
    # Set up again: checked, left as is.
    assert qdrant.setup_collection(collection_name) == layout


def test_binary_quantization_and_mismatched_collections(fern, collection_name, monkeypatch):
    client = FernQdrantClient(":memory:", fern=fern)
    created = created_with(monkeypatch)
    client.setup_collection(collection_name, quantization="binary", sparse=None)
    config = client.get_collection(collection_name).config
    assert isinstance(created[0]["quantization_config"], models.BinaryQuantization)
    assert config.params.sparse_vectors in (None, {})
    with pytest.raises(ValueError, match="quantization must be one of"):
        client.setup_collection("other", quantization="pq")
    client.create_collection("small", vectors_config={
        "dense": models.VectorParams(size=8, distance=models.Distance.COSINE)})
    with pytest.raises(ValueError, match="'small'.*size 8.*384"):
        client.setup_collection("small")
    client.close()


@pytest.fixture
def corpus(qdrant: FernQdrantClient, collection_name: str) -> str:
    qdrant.setup_collection(collection_name)
    qdrant.ingest(collection_name, CORPUS, progress=False)
    return collection_name


def ids(hits) -> list[str]:
    return [h.payload["id"] for h in hits]


def test_dense_and_hybrid_search_on_a_corpus_where_lexical_and_semantic_differ(qdrant, corpus):
    # Dense: meaning only. The gala shares the word "automobile" but is about a dinner.
    assert ids(qdrant.search(corpus, "automobile repair", k=2, hybrid=False)) == ["mechanic", "dealer"]
    # Hybrid: the only lexical match joins the semantic best one in the top 2.
    assert ids(qdrant.search(corpus, "automobile repair", k=2)) == ["gala", "mechanic"]
    # A query with no lexical overlap still finds its meaning through the dense prefetch.
    assert ids(qdrant.search(corpus, "how does the moon move the sea", k=1)) == ["tides"]


def test_hybrid_search_is_one_query_with_two_prefetches_fused_by_rrf(qdrant, corpus, fern,
                                                                      monkeypatch):
    sent, calls = [], []
    real_query, real_embed = QdrantClient.query_points, fern.embed

    def recording_query(self, *args, **kwargs):
        sent.append(inspect.signature(real_query).bind(self, *args, **kwargs).arguments)
        return real_query(self, *args, **kwargs)

    def recording_embed(texts, **options):
        calls.append(options)
        return real_embed(texts, **options)

    monkeypatch.setattr(QdrantClient, "query_points", recording_query)
    monkeypatch.setattr(fern, "embed", recording_embed)
    cars = models.Filter(must=[models.FieldCondition(key="topic",
                                                     match=models.MatchValue(value="cars"))])
    hits = qdrant.search(corpus, "automobile repair", k=3, filter=cars)
    assert ids(hits) == ["mechanic", "dealer"]  # only the "cars" topic is left
    assert len(calls) == 1 and calls[0]["lane"] == "online" and calls[0]["sparse"] is True
    assert len(sent) == 1
    query = sent[0]
    assert query["query"] == models.FusionQuery(fusion=models.Fusion.RRF)
    assert [p.using for p in query["prefetch"]] == ["dense", "sparse"]
    assert isinstance(query["prefetch"][1].query, models.SparseVector)
    assert all(p.filter == cars for p in query["prefetch"])
    # The query's BM25 form: each distinct term once with weight 1, so the IDF modifier gives BM25.
    assert calls[0]["prompt"] == "query" and set(query["prefetch"][1].query.values) == {1.0}


def test_search_errors_name_the_problem(qdrant, corpus, fern, collection_name):
    with pytest.raises(ValueError, match="empty"):
        qdrant.search(corpus, "")
    dense_only = collection_name + "-dense"
    qdrant.setup_collection(dense_only, sparse=None)
    with pytest.raises(ValueError, match=f"{dense_only!r} has no sparse vector"):
        qdrant.search(dense_only, "anything")
