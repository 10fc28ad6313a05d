"""Fern's Qdrant clients upload exactly what stock qdrant-client uploads for the same calls, or fail as it does.

Each case runs once on stock QdrantClient / AsyncQdrantClient (local mode, plain vectors
the sidecar computed beforehand) and once on FernQdrantClient / AsyncFernQdrantClient
(the same points with Fern Documents): the outcome — points stored, or the exception
type — must be the same, and the Fern points must carry the sidecar's vectors.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from qdrant_client import AsyncQdrantClient, QdrantClient, models

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from sidecar.client import AsyncFernClient, FernClient

N = 12
TEXTS = [f"point number {i} talks about topic {i % 3}" for i in range(N)]
COLLECTION = "uploads"


@pytest.fixture(scope="module")
def fern(sidecar_target: str) -> Iterator[FernClient]:
    with FernClient(sidecar_target) as client:
        client.wait_ready()
        yield client


@pytest.fixture(scope="module")
def reference(fern: FernClient) -> np.ndarray:
    return fern.embed(TEXTS, lane="batch").vectors


def create(client: QdrantClient, size: int) -> None:
    client.create_collection(COLLECTION, vectors_config={
        "dense": models.VectorParams(size=size, distance=models.Distance.COSINE)})


def documents() -> list[dict[str, models.Document]]:
    return [{"dense": models.Document(text=t, model="fern/")} for t in TEXTS]


def plain(reference: np.ndarray) -> list[dict[str, list[float]]]:
    return [{"dense": v.tolist()} for v in reference]


def outcome(client: QdrantClient, call: Callable[[], Any]) -> tuple[str, Any]:
    """("stored", points) when `call` returns, else ("raised", exception type, points stored)."""
    try:
        call()
    except Exception as err:  # the type is the outcome under comparison
        return "raised", type(err), client.count(COLLECTION).count
    return "stored", client.count(COLLECTION).count


def check_vectors(client: QdrantClient, reference: np.ndarray) -> None:
    points = client.scroll(COLLECTION, limit=10 * N, with_vectors=True, with_payload=True)[0]
    for p in points:
        want = reference[TEXTS.index(p.payload["text"])] if p.payload else None
        if want is not None:
            got = np.asarray(p.vector["dense"])
            cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
            assert cos >= 0.99999, p


def payloads(n: int = N) -> list[dict[str, str]]:
    return [{"text": t} for t in TEXTS[:n]]


# Each case: (name, kwargs for upload_collection given the vectors list); the vectors are a
# list (so stock checks ids and payload lengths at once) unless the case makes a generator.
CASES: list[tuple[str, Callable[[list], dict[str, Any]]]] = [
    ("all lists", lambda v: dict(vectors=v, ids=list(range(N)), payload=payloads())),
    ("ids list shorter", lambda v: dict(vectors=v, ids=list(range(N - 3)), payload=payloads())),
    ("payload list shorter", lambda v: dict(vectors=v, ids=list(range(N)), payload=payloads(N - 1))),
    ("ids stream shorter", lambda v: dict(vectors=v, ids=iter(range(N - 2)), payload=payloads())),
    ("ids stream longer", lambda v: dict(vectors=v, ids=iter(range(10 * N)), payload=payloads())),
    ("vectors tuple, no ids", lambda v: dict(vectors=tuple(v), payload=payloads())),
    ("vectors stream, ids shorter", lambda v: dict(vectors=iter(v), ids=list(range(N - 4)),
                                                   payload=payloads())),
]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_upload_collection_matches_stock(fern, reference, name, kwargs):
    stock = QdrantClient(":memory:")
    create(stock, reference.shape[1])
    want = outcome(stock, lambda: stock.upload_collection(COLLECTION, batch_size=5,
                                                          **kwargs(plain(reference))))
    client = FernQdrantClient(":memory:", fern=fern)
    create(client, reference.shape[1])
    got = outcome(client, lambda: client.upload_collection(COLLECTION, batch_size=5,
                                                           **kwargs(documents())))
    assert got == want, name
    check_vectors(client, reference)


@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_async_upload_collection_matches_stock_and_embeds_documents(sidecar_target, reference,
                                                                     name, kwargs):
    async def run(client: AsyncQdrantClient, vectors: list) -> tuple:
        await client.create_collection(COLLECTION, vectors_config={
            "dense": models.VectorParams(size=reference.shape[1],
                                         distance=models.Distance.COSINE)})
        try:
            client.upload_collection(COLLECTION, batch_size=5, **kwargs(vectors))
        except Exception as err:  # the type is the outcome under comparison
            return "raised", type(err), (await client.count(COLLECTION)).count
        return "stored", (await client.count(COLLECTION)).count

    async def scenario() -> tuple:
        want = await run(AsyncQdrantClient(":memory:"), plain(reference))
        fern = AsyncFernClient(sidecar_target)
        client = AsyncFernQdrantClient(":memory:", fern=fern)
        got = await run(client, documents())
        points = (await client.scroll(COLLECTION, limit=10 * N, with_vectors=True,
                                      with_payload=True))[0]
        await client.close()
        await fern.close()
        return want, got, points

    want, got, points = asyncio.run(scenario())
    assert got == want, name
    for p in points:
        if p.payload:
            want_vector = reference[TEXTS.index(p.payload["text"])]
            assert np.allclose(p.vector["dense"], want_vector, atol=1e-5)


def test_async_upload_points_is_a_plain_method_like_stock(sidecar_target, reference):
    """Called the stock way (not awaited), every point lands, with the sidecar's vectors."""
    assert not inspect.iscoroutinefunction(AsyncQdrantClient.upload_points)
    assert not inspect.iscoroutinefunction(AsyncFernQdrantClient.upload_points)

    async def scenario() -> tuple:
        fern = AsyncFernClient(sidecar_target)
        client = AsyncFernQdrantClient(":memory:", fern=fern)
        await client.create_collection(COLLECTION, vectors_config={
            "dense": models.VectorParams(size=reference.shape[1],
                                         distance=models.Distance.COSINE)})
        points = (models.PointStruct(id=i, vector=d, payload={"text": t})
                  for i, (d, t) in enumerate(zip(documents(), TEXTS)))
        returned = client.upload_points(COLLECTION, points, batch_size=5)
        count = (await client.count(COLLECTION)).count
        stored = (await client.retrieve(COLLECTION, list(range(N)), with_vectors=True))
        await client.close()
        await fern.close()
        return returned, count, stored

    returned, count, stored = asyncio.run(scenario())
    assert returned is None
    assert count == N
    vectors = np.array([p.vector["dense"] for p in sorted(stored, key=lambda p: p.id)])
    assert np.allclose(vectors, reference, atol=1e-5)


def test_upload_points_matches_stock_for_a_stream(fern, reference):
    stock = QdrantClient(":memory:")
    create(stock, reference.shape[1])
    stock.upload_points(COLLECTION, (models.PointStruct(id=i, vector=v, payload=p) for i, (v, p)
                                     in enumerate(zip(plain(reference), payloads()))),
                        batch_size=5)
    client = FernQdrantClient(":memory:", fern=fern)
    create(client, reference.shape[1])
    assert client.upload_points(
        COLLECTION, (models.PointStruct(id=i, vector=v, payload=p) for i, (v, p)
                     in enumerate(zip(documents(), payloads()))), batch_size=5) is None
    assert client.count(COLLECTION).count == stock.count(COLLECTION).count == N
    check_vectors(client, reference)
