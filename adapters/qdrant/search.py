"""Query-time embedding: one ONLINE-lane sidecar call, one query_points (dense, or dense + sparse fused by RRF)."""

from __future__ import annotations

from typing import Any

from qdrant_client import QdrantClient, models

from adapters.qdrant.collection import CollectionLayout
from adapters.qdrant.documents import qdrant_sparse
from sidecar.client import Embeddings, FernClient, ModelInfo


def query_prompt(info: ModelInfo) -> str | None:
    """The prompt a search embeds its text with: "query", which every model accepts.

    It is the model's query prompt where the model defines one (and adds no text where it
    does not), and it asks the sidecar for BM25's query form of the sparse vector: each
    distinct term once, so that the IDF modifier scores the documents by BM25."""
    return "query"


def check_search(collection: str, text: str, k: int, hybrid: bool,
                 layout: CollectionLayout) -> None:
    """Errors a caller can cause, named before anything is sent."""
    if not text:
        raise ValueError("search text is empty")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if hybrid and layout.sparse is None:
        raise ValueError(f"collection {collection!r} has no sparse vector; "
                         f"use hybrid=False or recreate it with a sparse vector")


def query_arguments(emb: Embeddings, layout: CollectionLayout, k: int,
                    filter: models.Filter | None, hybrid: bool, prefetch_limit: int | None,
                    with_payload: bool | list[str]) -> dict[str, Any]:
    """query_points keyword arguments for the query's embedding (first row of `emb`)."""
    dense = emb.vectors[0].astype("float32", copy=False).tolist()
    if not hybrid:
        return dict(query=dense, using=layout.dense, query_filter=filter, limit=k,
                    with_payload=with_payload)
    depth = prefetch_limit or max(4 * k, 20)
    prefetch = [
        models.Prefetch(query=dense, using=layout.dense, filter=filter, limit=depth),
        models.Prefetch(query=qdrant_sparse(emb.sparse[0]), using=layout.sparse, filter=filter,
                        limit=depth),
    ]
    return dict(prefetch=prefetch, query=models.FusionQuery(fusion=models.Fusion.RRF),
                query_filter=filter, limit=k, with_payload=with_payload)


def search(client: QdrantClient, fern: FernClient, collection: str, text: str, k: int = 10,
           filter: models.Filter | None = None, hybrid: bool = True, *,
           layout: CollectionLayout, prompt: str | None = None,
           prefetch_limit: int | None = None,
           with_payload: bool | list[str] = True) -> list[models.ScoredPoint]:
    """The `k` best points for `text`.

    hybrid=True: one query_points with two prefetches (the dense vector and the sparse
    lexical one, each `prefetch_limit` deep, default max(4k, 20)) fused by reciprocal
    rank fusion; the filter applies to both. hybrid=False: dense nearest neighbours.
    """
    check_search(collection, text, k, hybrid, layout)
    emb = fern.embed([text], model=layout.model, lane="online", prompt=prompt, sparse=hybrid)
    return client.query_points(collection, **query_arguments(
        emb, layout, k, filter, hybrid, prefetch_limit, with_payload)).points
