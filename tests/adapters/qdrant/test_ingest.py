"""Bulk ingest through EmbedStream: stored vectors, ids and payloads, bounded memory, idempotent re-runs, sidecar loss."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np
import pytest
from qdrant_client import QdrantClient

from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.ingest import IngestError, point_id
from sidecar.client import FernClient


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def articles(n: int, start: int = 0):
    for i in range(start, start + n):
        yield {"key": f"doc-{i}", "title": f"Article {i}",
               "body": f"Article number {i} talks about topic {i % 7} and the number {i * 13}.",
               "rank": i}


def all_points(client: QdrantClient, collection: str) -> list:
    points, offset = [], None
    while True:
        batch, offset = client.scroll(collection, limit=256, offset=offset, with_vectors=True)
        points += batch
        if offset is None:
            return points


def test_ingest_records_stores_sidecar_vectors_ids_and_payloads(qdrant, fern, collection_name):
    qdrant.setup_collection(collection_name)
    records = list(articles(45))
    summary = qdrant.ingest(collection_name, iter(records), text="{title}\n\n{body}", id="key",
                            batch_size=8, max_in_flight=3, progress=False)
    assert summary.rows == 45 and summary.requests == 6 and summary.rows_per_second > 0
    assert "45 rows" in str(summary) and "rows/s" in str(summary)

    texts = [f"{r['title']}\n\n{r['body']}" for r in records]
    reference = fern.embed(texts, lane="batch", sparse=True)
    by_id = {p.id: p for p in all_points(qdrant, collection_name)}
    assert sorted(by_id) == sorted(point_id(r["key"]) for r in records)
    stored = np.array([by_id[point_id(r["key"])].vector["dense"] for r in records])
    assert cosine(stored, reference.vectors).min() >= 0.99999
    for r, ref_sparse in zip(records, reference.sparse):
        point = by_id[point_id(r["key"])]
        assert point.payload == r
        assert sorted(point.vector["sparse"].indices) == ref_sparse.indices.tolist()


def test_reingest_is_idempotent_and_payload_fields_can_be_chosen(fern, collection_name):
    client = FernQdrantClient(":memory:", fern=fern)
    client.setup_collection(collection_name, sparse=None)
    client.ingest(collection_name, articles(20), text="body", id=lambda r: r["key"],
                  payload=["title"], batch_size=6, progress=False)
    client.ingest(collection_name, articles(30), text="body", id=lambda r: r["key"],
                  payload=["title"], batch_size=7, progress=False)
    points = all_points(client, collection_name)
    assert len(points) == 30
    assert {p.payload["title"] for p in points} == {f"Article {i}" for i in range(30)}
    assert all(set(p.payload) == {"title"} for p in points)
    client.close()


def test_memory_stays_bounded_by_in_flight_requests(fern, collection_name, monkeypatch):
    client = FernQdrantClient(":memory:", fern=fern)
    client.setup_collection(collection_name)
    upserted = [0]
    real_upsert = QdrantClient.upsert

    def counting_upsert(self, collection, points, *args, **kwargs):
        result = real_upsert(self, collection, points, *args, **kwargs)
        upserted[0] += len(points.ids)
        return result

    monkeypatch.setattr(QdrantClient, "upsert", counting_upsert)
    ahead = []

    def records():
        for i, r in enumerate(articles(120)):
            ahead.append(i - upserted[0])
            yield r

    client.ingest(collection_name, records(), text="body", id="key", batch_size=10,
                  max_in_flight=2, progress=False)
    assert upserted[0] == 120
    # Reading never runs more than the in-flight requests (plus the one being built) ahead.
    assert max(ahead) < (2 + 1) * 10
    client.close()


def test_sidecar_lost_mid_ingest_reports_progress_and_rerun_completes(
        fern, relay, sidecar_target, tmp_path):
    path = str(tmp_path / "qdrant")
    total, cut_after = 300, 150

    def records():
        for i, r in enumerate(articles(total)):
            if i == cut_after:
                relay.close()  # the sidecar goes away while requests are in flight
            yield r

    first = FernQdrantClient(path=path, fern=FernClient(relay.target))
    first.setup_collection("docs")
    with pytest.raises(IngestError) as info:
        first.ingest("docs", records(), text="body", id="key", batch_size=10, max_in_flight=2,
                     progress=False)
    err = info.value
    assert 0 < err.rows_upserted < total
    assert err.rows_upserted <= err.rows_read <= total
    message = str(err)
    assert f"{err.rows_upserted:,} rows upserted" in message
    assert relay.target in message and "again" in message
    assert first.count("docs").count == err.rows_upserted  # the report matches the collection
    first.close()

    # A new process opens the same collection and runs the same ingest again.
    second = FernQdrantClient(path=path, fern=sidecar_target)
    summary = second.ingest("docs", articles(total), text="body", id="key", batch_size=10,
                            progress=False)
    assert summary.rows == total
    ids = {p.id for p in all_points(second, "docs")}
    assert ids == {point_id(f"doc-{i}") for i in range(total)}
    assert second.count("docs").count == total
    second.close()


def test_no_sidecar_listening_is_a_clear_error(fern, collection_name):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections refused
        client = FernQdrantClient(":memory:", fern=fern)
        client.setup_collection(collection_name)
        client.fern = FernClient(dead)
        with pytest.raises(IngestError, match=f"0 rows upserted.*{dead}") as info:
            client.ingest(collection_name, articles(5), text="body", id="key", progress=False)
    assert info.value.rows_upserted == 0
    client.close()


def test_bad_records_are_named(fern, collection_name):
    client = FernQdrantClient(":memory:", fern=fern)
    client.setup_collection(collection_name)
    rows = list(articles(12))
    del rows[9]["title"]
    with pytest.raises(IngestError, match=r"record 9 \(id 'doc-9'\).*'title'"):
        client.ingest(collection_name, rows, text="{title}: {body}", id="key", batch_size=4,
                      progress=False)
    rows = list(articles(6))
    rows[4]["body"] = ""
    with pytest.raises(IngestError, match=r"record 4 \(id 'doc-4'\)"):
        client.ingest(collection_name, rows, text="body", id="key", batch_size=4, progress=False)
    with pytest.raises(IngestError, match="its id is None"):
        client.ingest(collection_name, [{"text": "x", "id": None}], progress=False)
    client.close()


def test_payload_from_dataclasses(fern, collection_name):
    @dataclass
    class Note:
        nid: int
        text: str

    client = FernQdrantClient(":memory:", fern=fern)
    client.setup_collection(collection_name, sparse=None)
    client.ingest(collection_name, [Note(1, "first note"), Note(2, "second note")], id="nid",
                  progress=False)
    assert {p.payload["text"] for p in all_points(client, collection_name)} == {
        "first note", "second note"}
    client.close()


def test_qdrant_failure_mid_ingest_reports_progress(fern, collection_name, monkeypatch):
    client = FernQdrantClient(":memory:", fern=fern)
    client.setup_collection(collection_name)
    real_upsert = QdrantClient.upsert
    calls = [0]

    def failing_third_upsert(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise ConnectionError("qdrant went away")
        return real_upsert(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "upsert", failing_third_upsert)
    with pytest.raises(IngestError, match="after 20 rows upserted.*upsert into Qdrant failed: "
                                          "qdrant went away") as info:
        client.ingest(collection_name, articles(50), text="body", id="key", batch_size=10,
                      progress=False)
    assert info.value.rows_upserted == 20 == client.count(collection_name).count
    client.close()
