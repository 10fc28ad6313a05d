"""FernQdrantClient with models.Document: Fern documents embedded by the sidecar, others left to qdrant-client."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from qdrant_client import QdrantClient, models

from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.demo import CORPUS
from adapters.qdrant.documents import FernModels, walk
from sidecar.client import FernClient, FernError


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


class CallLog:
    """Wraps a FernClient's embed() to record each call's texts, lane and sparse flag."""

    def __init__(self, fern: FernClient, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[list[str], str, bool]] = []
        real = fern.embed

        def embed(texts, **options):
            self.calls.append((list(texts), options.get("lane"), options.get("sparse", False)))
            return real(texts, **options)

        monkeypatch.setattr(fern, "embed", embed)


def doc(text: str, **options) -> models.Document:
    return models.Document(text=text, model="fern/", options=options or None)


def stored(client: QdrantClient, collection: str, ids) -> dict:
    points = client.retrieve(collection, ids, with_vectors=True, with_payload=True)
    return {p.id: p for p in points}


@pytest.fixture
def setup(qdrant: FernQdrantClient, collection_name: str) -> str:
    qdrant.setup_collection(collection_name)
    return collection_name


def test_upsert_points_with_documents_stores_sidecar_vectors(qdrant, fern, setup, monkeypatch):
    log = CallLog(fern, monkeypatch)
    texts = [r["text"] for r in CORPUS[:4]]
    points = [models.PointStruct(id=i, payload={"n": i, "tags": ["a", i]},
                                 vector={"dense": doc(t), "sparse": doc(t, sparse=True)})
              for i, t in enumerate(texts)]
    qdrant.upsert(setup, points)

    assert log.calls == [(texts, "batch", True)]  # one sidecar call for the whole upsert
    reference = fern.embed(texts, lane="batch", sparse=True)
    got = stored(qdrant, setup, list(range(4)))
    assert sorted(got) == [0, 1, 2, 3]
    dense = np.array([got[i].vector["dense"] for i in range(4)])
    assert cosine(dense, reference.vectors).min() >= 0.99999
    for i in range(4):
        assert got[i].payload == {"n": i, "tags": ["a", i]}
        sparse = got[i].vector["sparse"]
        order = np.argsort(sparse.indices)
        np.testing.assert_array_equal(np.asarray(sparse.indices)[order], reference.sparse[i].indices)
        np.testing.assert_allclose(np.asarray(sparse.values)[order], reference.sparse[i].values,
                                   rtol=1e-6)
    # The caller's objects are not modified.
    assert isinstance(points[0].vector["dense"], models.Document)


def test_upsert_batch_and_batch_update_operations(qdrant, fern, setup, monkeypatch):
    log = CallLog(fern, monkeypatch)
    texts = [r["text"] for r in CORPUS]
    qdrant.upsert(setup, models.Batch(ids=[1, 2], vectors={"dense": [doc(texts[0]), doc(texts[1])]},
                                      payloads=[{"k": 1}, {"k": 2}]))
    qdrant.batch_update_points(setup, [
        models.UpsertOperation(upsert=models.PointsList(points=[
            models.PointStruct(id=3, vector={"dense": doc(texts[2])}, payload={"k": 3})])),
        models.UpdateVectorsOperation(update_vectors=models.UpdateVectors(points=[
            models.PointVectors(id=1, vector={"dense": doc(texts[3])})])),
    ])
    assert [c[1] for c in log.calls] == ["batch", "batch"]
    assert log.calls[1][0] == [texts[2], texts[3]]  # both operations in one call

    reference = fern.embed([texts[3], texts[1], texts[2]], lane="batch").vectors
    got = stored(qdrant, setup, [1, 2, 3])
    dense = np.array([got[i].vector["dense"] for i in (1, 2, 3)])
    assert cosine(dense, reference).min() >= 0.99999
    assert [got[i].payload["k"] for i in (1, 2, 3)] == [1, 2, 3]


def test_upload_points_embeds_lazily_per_batch(qdrant, fern, setup, monkeypatch):
    log = CallLog(fern, monkeypatch)
    texts = [r["text"] for r in CORPUS]
    points = (models.PointStruct(id=i, vector={"dense": doc(t)}, payload={"i": i})
              for i, t in enumerate(texts))
    qdrant.upload_points(setup, points, batch_size=4, wait=True)
    assert [len(c[0]) for c in log.calls] == [4, 4, 1]
    assert {c[1] for c in log.calls} == {"batch"}
    assert qdrant.count(setup).count == len(texts)
    got = stored(qdrant, setup, list(range(len(texts))))
    dense = np.array([got[i].vector["dense"] for i in range(len(texts))])
    assert cosine(dense, fern.embed(texts, lane="batch").vectors).min() >= 0.99999


def test_query_points_with_a_document(qdrant, fern, setup, monkeypatch):
    qdrant.ingest(setup, CORPUS, progress=False)
    log = CallLog(fern, monkeypatch)
    hits = qdrant.query_points(setup, query=doc("how does the moon move the sea"),
                               using="dense", limit=2, with_payload=True).points
    assert hits[0].payload["id"] == "tides"
    assert log.calls == [(["how does the moon move the sea"], "online", False)]


def test_query_batch_points_and_hybrid_prefetch_with_documents(qdrant, fern, setup, monkeypatch):
    qdrant.ingest(setup, CORPUS, progress=False)
    log = CallLog(fern, monkeypatch)
    q = "automobile repair"
    dense, sparse, fused = qdrant.query_batch_points(setup, [
        models.QueryRequest(query=doc(q), using="dense", limit=2, with_payload=True),
        models.QueryRequest(query=doc(q, sparse=True), using="sparse", limit=2, with_payload=True),
        models.QueryRequest(prefetch=[models.Prefetch(query=doc(q), using="dense", limit=20),
                                      models.Prefetch(query=doc(q, sparse=True), using="sparse",
                                                      limit=20)],
                            query=models.FusionQuery(fusion=models.Fusion.RRF), limit=2,
                            with_payload=True),
    ])
    # Five Documents, one distinct text: one ONLINE call that returns dense and sparse.
    assert log.calls == [([q], "online", True)]
    assert [p.payload["id"] for p in dense.points] == ["mechanic", "dealer"]
    assert [p.payload["id"] for p in sparse.points] == ["gala"]  # the only lexical match
    assert [p.payload["id"] for p in fused.points] == ["gala", "mechanic"]


def test_documents_for_other_models_reach_qdrant_client_unchanged(fern, monkeypatch):
    client = FernQdrantClient(":memory:", fern=fern)
    client.create_collection("mixed", vectors_config={
        "dense": models.VectorParams(size=384, distance=models.Distance.COSINE),
        "other": models.VectorParams(size=384, distance=models.Distance.COSINE)})
    other = models.Document(text="left to FastEmbed", model="BAAI/bge-small-en-v1.5")
    ours = doc("embedded by Fern")
    seen = []
    real_upsert = QdrantClient.upsert

    def recording_upsert(self, collection_name, points, *args, **kwargs):
        seen.append(points)
        return real_upsert(self, collection_name, points, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "upsert", recording_upsert)
    point = models.PointStruct(id=1, vector={"dense": ours, "other": other})
    if importlib.util.find_spec("fastembed") is None:
        with pytest.raises(ImportError, match="fastembed"):
            client.upsert("mixed", [point])
    else:
        client.upsert("mixed", [point])
    vectors = seen[0][0].vector
    assert vectors["other"] is other
    expected = fern.embed(["embedded by Fern"], lane="batch").vectors
    assert cosine([vectors["dense"]], expected)[0] >= 0.99999
    client.close()


def test_mapping_routes_fastembed_model_names_to_fern(fern):
    client = FernQdrantClient(":memory:", fern=fern,
                              fern_models={"sentence-transformers/all-MiniLM-L6-v2": ""})
    client.setup_collection("mapped", sparse=None)
    client.upsert("mapped", [models.PointStruct(id=1, vector={"dense": models.Document(
        text="hello world", model="sentence-transformers/all-MiniLM-L6-v2")})])
    got = client.retrieve("mapped", [1], with_vectors=True)[0].vector["dense"]
    assert cosine([got], fern.embed(["hello world"], lane="batch").vectors)[0] >= 0.99999
    client.close()


def test_bad_document_options_and_sidecar_errors_name_the_input(qdrant, setup):
    with pytest.raises(ValueError, match="unknown option.*colour"):
        qdrant.upsert(setup, [models.PointStruct(id=1, vector={"dense": doc("x", colour="red")})])
    with pytest.raises(FernError) as info:
        qdrant.query_points(setup, query=models.Document(text="x", model="fern/no-such-model"),
                            using="dense")
    assert "no-such-model" in str(info.value)


def test_fern_models_resolution_and_walk_identity():
    fm = FernModels(mapping={"BAAI/bge-m3": "bge-m3"})
    assert fm.resolve("fern/all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert fm.resolve("fern/") == "" and fm.resolve("fern/default") == ""
    assert fm.resolve("BAAI/bge-m3") == "bge-m3"
    assert fm.resolve("BAAI/bge-small-en-v1.5") is None
    request = [models.PointStruct(id=1, vector=[0.1, 0.2], payload={"a": [1, 2]})]
    assert walk(request, lambda d: [1.0]) is request  # nothing to replace: same objects back
