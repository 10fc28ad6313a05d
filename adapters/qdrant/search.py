"""Query-time embedding: one ONLINE-lane sidecar call, one query_points (dense, dense + sparse fused by RRF,
or either reranked by the multi-vector's MaxSim), and with `rerank_text` one Rerank call that rescores the
best of them by a cross-encoder on the sidecar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qdrant_client import QdrantClient, models

from adapters.qdrant.collection import CollectionLayout
from adapters.qdrant.documents import qdrant_sparse
from adapters.qdrant.ingest import TextSpec, text_getter
from sidecar.client import Embeddings, FernClient, ModelInfo, Reranking


def query_prompt(info: ModelInfo) -> str | None:
    """The prompt a search embeds its text with: "query", which every model accepts.

    It is the model's query prompt where the model defines one (and adds no text where it
    does not), and it asks the sidecar for BM25's query form of the sparse vector: each
    distinct term once, so that the IDF modifier scores the documents by BM25."""
    return "query"


def check_search(collection: str, text: str, k: int, hybrid: bool,
                 layout: CollectionLayout, rerank: bool = False, rerank_text: TextSpec | None = None,
                 rerank_top: int | None = None, rerank_model: str = "") -> None:
    """Errors a caller can cause, named before anything is sent."""
    if rerank_text is None and (rerank_top is not None or rerank_model):
        raise ValueError("rerank_top and rerank_model rerank by a cross-encoder, which reads each point's text: "
                         "give rerank_text too (a payload field, a template or a callable)")
    if not text:
        raise ValueError("search text is empty")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if rerank_top is not None and rerank_top < k:
        raise ValueError(f"rerank_top must be at least k ({k}): it is how many of the best points are "
                         f"reranked, got {rerank_top}")
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
           with_payload: bool | list[str] = True, rerank: bool | None = None,
           rerank_text: TextSpec | None = None, rerank_top: int | None = None,
           rerank_model: str = "") -> list[models.ScoredPoint]:
    """The `k` best points for `text`.

    hybrid=True: one query_points with two prefetches (the dense vector and the sparse
    lexical one, each `prefetch_limit` deep, default max(4k, 20)) fused by reciprocal
    rank fusion; the filter applies to both. hybrid=False: dense nearest neighbours.
    rerank (default: when the collection has a multi-vector): the prefetched candidates,
    dense and (hybrid) sparse, are ordered by the query's multi-vector's MaxSim instead of
    by fusion, still in the one query_points.
    rerank_text (a payload field, a template over the payload such as "{title}\n\n{body}", or a
    callable(payload)): that query returns the best `rerank_top` points (default max(4k, 20)),
    and one Rerank call on the sidecar scores each one's text against `text` with the
    cross-encoder `rerank_model` ("": the sidecar's first reranker); the best k come back in
    its order, `score` the reranker's (sigmoid, 0..1).
    """
    rerank = reranks(layout, rerank)
    check_search(collection, text, k, hybrid, layout, rerank, rerank_text, rerank_top, rerank_model)
    emb = fern.embed([text], model=layout.model, lane="online", prompt=prompt, sparse=hybrid,
                     multivector=rerank)
    if rerank_text is None:
        return client.query_points(collection, **query_arguments(
            emb, layout, k, filter, hybrid, prefetch_limit, with_payload, rerank)).points
    points = client.query_points(collection, **query_arguments(
        emb, layout, candidates(k, rerank_top), filter, hybrid, prefetch_limit, True, rerank)).points
    scored, texts = documents_to_rerank(points, rerank_text)
    ranking = fern.rerank(text, texts, model=rerank_model, top_n=k, lane="online") if texts else None
    return reranked(points, scored, ranking, k, with_payload)


def candidates(k: int, rerank_top: int | None) -> int:
    """How many points the first stage returns for a cross-encoder to rerank: `rerank_top`, else max(4k, 20)."""
    return rerank_top if rerank_top is not None else max(4 * k, 20)


def documents_to_rerank(points: Sequence[models.ScoredPoint], rerank_text: TextSpec) -> tuple[list[int], list[str]]:
    """The candidates with text to score (their indices) and that text, read from each payload; a candidate
    whose payload lacks it follows every scored one.

    A field or template that no candidate's payload has is the caller's mistake, not the data's:
    refused, naming it."""
    render = text_getter(rerank_text)
    scored, texts, missing = [], [], None
    for i, point in enumerate(points):
        try:
            text = render(point.payload or {})
        except (KeyError, AttributeError) as error:
            missing = error
            continue
        if isinstance(text, str) and text.strip():
            scored.append(i)
            texts.append(text)
    if missing is not None and not scored:
        raise ValueError(f"rerank_text {rerank_text!r}: no candidate's payload has {missing}; name a payload "
                         "field or a template over the payload's fields")
    return scored, texts


def reranked(points: Sequence[models.ScoredPoint], scored: Sequence[int], ranking: Reranking | None, k: int,
             with_payload: bool | list[str]) -> list[models.ScoredPoint]:
    """The best `k` points in the reranker's order, each with the reranker's score as its `score`;
    candidates with no text after them in the first stage's order; payloads as `with_payload` asked."""
    out = [points[scored[r.index]].model_copy(update={"score": r.score}) for r in (ranking.results if ranking else [])]
    ranked = set(scored)
    out += [p for i, p in enumerate(points) if i not in ranked]
    return [_payload_as_asked(p, with_payload) for p in out[:k]]


def _payload_as_asked(point: models.ScoredPoint, with_payload: bool | list[str]) -> models.ScoredPoint:
    """The candidates were fetched with their whole payload (the reranker reads it): trim it to what was asked."""
    if with_payload is True:
        return point
    if with_payload is False:
        return point.model_copy(update={"payload": None})
    return point.model_copy(update={"payload": {k: v for k, v in (point.payload or {}).items() if k in with_payload}})
