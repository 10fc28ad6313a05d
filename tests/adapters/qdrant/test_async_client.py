"""AsyncFernQdrantClient: the same Document substitution and search, awaited, on AsyncFernClient."""

from __future__ import annotations

import asyncio

import numpy as np
from qdrant_client import models

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.demo import CORPUS
from sidecar.client import AsyncFernClient


def test_async_client_upserts_queries_and_searches(sidecar_target, fern, tmp_path):
    path = str(tmp_path / "qdrant")
    setup = FernQdrantClient(path=path, fern=fern)
    setup.setup_collection("docs")
    setup.close()
    texts = [r["text"] for r in CORPUS]

    async def scenario():
        fern_async = AsyncFernClient(sidecar_target)
        client = AsyncFernQdrantClient(path=path, fern=fern_async)
        await client.upsert("docs", [
            models.PointStruct(id=i, payload=r, vector={
                "dense": models.Document(text=r["text"], model="fern/"),
                "sparse": models.Document(text=r["text"], model="fern/", options={"sparse": True})})
            for i, r in enumerate(CORPUS)])
        stored = await client.retrieve("docs", list(range(len(CORPUS))), with_vectors=True)
        by_doc = await client.query_points(
            "docs", query=models.Document(text="a cup of coffee", model="fern/"), using="dense",
            limit=1)
        dense = await client.search("docs", "automobile repair", k=2, hybrid=False)
        hybrid = await client.search("docs", "automobile repair", k=2)
        await client.close()
        await fern_async.close()
        return stored, by_doc, dense, hybrid

    stored, by_doc, dense, hybrid = asyncio.run(scenario())
    vectors = np.array([p.vector["dense"] for p in sorted(stored, key=lambda p: p.id)])
    reference = fern.embed(texts, lane="batch").vectors
    cos = (vectors * reference).sum(1) / (np.linalg.norm(vectors, axis=1)
                                          * np.linalg.norm(reference, axis=1))
    assert cos.min() >= 0.99999
    assert by_doc.points[0].payload["id"] == "espresso"
    assert [h.payload["id"] for h in dense] == ["mechanic", "dealer"]
    assert [h.payload["id"] for h in hybrid] == ["gala", "mechanic"]
