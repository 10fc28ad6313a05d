"""Query-time embedding: one ONLINE-lane sidecar call, one query_points (dense, dense + sparse fused by RRF,
or either reranked by the multi-vector's MaxSim)."""

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
                 layout: CollectionLayout, rerank: bool = False) -> None:
    """Errors a caller can cause, named before anything is sent."""
    if not text:
        raise ValueError("search text is empty")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if hybrid and layout.sparse is None:
        raise ValueError(f"collection {collection!r} has no sparse vector; "
                         f"use hybrid=False or recreate it with a sparse vector")
    if rerank and layout.multivector is None:
        raise ValueError(f"collection {collection!r} has no multi-vector to rerank by; "
                         f"use rerank=False or recreate it with multivector=True")


def reranks(layout: CollectionLayout, rerank: bool | None) -> bool:
    """Whether a search reranks by the multi-vector: as asked, else whenever the collection has one."""
    return layout.multivector is not None if rerank is None else rerank


def query_arguments(emb: Embeddings, layout: CollectionLayout, k: int,
                    filter: models.Filter | None, hybrid: bool, prefetch_limit: int | None,
                    with_payload: bool | list[str], rerank: bool = False) -> dict[str, Any]:
    """query_points keyword arguments for the query's embedding (first row of `emb`)."""
    dense = emb.vectors[0].astype("float32", copy=False).tolist()
    if rerank:
        depth = prefetch_limit or max(4 * k, 20)
        prefetch = [models.Prefetch(query=dense, using=layout.dense, filter=filter, limit=depth)]
        if hybrid:
            prefetch.append(models.Prefetch(query=qdrant_sparse(emb.sparse[0]), using=layout.sparse,
                                            filter=filter, limit=depth))
        return dict(prefetch=prefetch, query=emb.multivectors[0].tolist(), using=layout.multivector,
                    query_filter=filter, limit=k, with_payload=with_payload)
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
           with_payload: bool | list[str] = True, rerank: bool | None = None) -> list[models.ScoredPoint]:
    """The `k` best points for `text`.

    hybrid=True: one query_points with two prefetches (the dense vector and the sparse
    lexical one, each `prefetch_limit` deep, default max(4k, 20)) fused by reciprocal
    rank fusion; the filter applies to both. hybrid=False: dense nearest neighbours.
    rerank (default: when the collection has a multi-vector): the prefetched candidates,
    dense and (hybrid) sparse, are ordered by the query's multi-vector's MaxSim instead of
    by fusion, still in the one query_points.
    """
    rerank = reranks(layout, rerank)
    check_search(collection, text, k, hybrid, layout, rerank)
    emb = fern.embed([text], model=layout.model, lane="online", prompt=prompt, sparse=hybrid,
                     multivector=rerank)
    return client.query_points(collection, **query_arguments(
        emb, layout, k, filter, hybrid, prefetch_limit, with_payload, rerank)).points
