"""Reranking over HTTP: TEI's `POST /rerank` and the Cohere / Jina shape of `POST /v1/rerank` (and Cohere's `/v2/rerank`).

TEI: ``{"query", "texts", "raw_scores" (false: sigmoid in 0..1), "return_text", "truncate"
(false: a pair over the model's limit is a 413)}`` answers ``[{"index", "score", "text"?}]``,
best first. Cohere / Jina: ``{"model", "query", "documents" (strings, or objects with
"text"), "top_n", "return_documents"}`` answers ``{"id", "results": [{"index",
"relevance_score", "document"?: {"text"}}], "meta"}``; documents are truncated at their end
to fit (Cohere truncates too). In both only the document is ever cut, never the query.
Fern's extras in both: `model` (default: the default model if it is a reranker, else the
first reranker served), `lane` (or the X-Fern-Lane header); `top_n` in TEI's; `truncate`
and `raw_scores` in Cohere's.
"""

from __future__ import annotations

import uuid

from sidecar.gateway import RerankParams, RerankResult
from sidecar.http.body import get_bool, get_lane, get_str, kind
from sidecar.http.errors import HttpError


def _query(payload: dict) -> str:
    value = payload.get("query")
    if value is None:
        raise HttpError(400, "query: missing; send the text to rank the documents against", param="query",
                        code="missing_input", error_type="empty")
    if not isinstance(value, str):
        raise HttpError(400, f"query: expected a string, got {kind(value)}", param="query", code="invalid_type")
    return value


def _documents(payload: dict, field: str, max_documents: int, objects: bool) -> list[str]:
    """`field` as a list of document texts; `objects`: Cohere's {"text": ...} items are taken too."""
    value = payload.get(field)
    if value is None:
        raise HttpError(400, f"{field}: missing; send a list of documents to rank", param=field,
                        code="missing_input", error_type="empty")
    if not isinstance(value, list):
        raise HttpError(400, f"{field}: expected a list of strings, got {kind(value)}", param=field,
                        code="invalid_type")
    if not value:
        raise HttpError(400, f"{field}: an empty list; send at least one document to rank", param=field,
                        code="empty_input", error_type="empty")
    if len(value) > max_documents:
        raise HttpError(413, f"{field}: {len(value)} documents exceeds the limit of {max_documents} per request; "
                             "rerank the best candidates of a first-stage search, or split them",
                        param=field, code="too_many_documents")
    texts = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            expected = 'a string or an object with a "text" string' if objects else "a string"
            raise HttpError(400, f"{field}[{i}]: expected {expected}, got {kind(item)}", param=field,
                            code="invalid_type")
        texts.append(item)
    return texts


def _top_n(payload: dict) -> int:
    value = payload.get("top_n")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HttpError(400, f"top_n: expected a positive integer, got {value!r}", param="top_n",
                        code="invalid_value")
    return value


def _unsupported(payload: dict, *names: str) -> None:
    for name in names:
        if payload.get(name) is not None:
            raise HttpError(400, f"{name}: not supported by Fern; each document is one (query, document) pair "
                                 "whose end is cut to the model's limit", param=name, code="unsupported")


def parse_tei(payload: dict, lane_header: str | None, max_documents: int) -> RerankParams:
    """The gateway's params for a TEI /rerank request."""
    direction = get_str(payload, "truncation_direction", "right")
    if direction.lower() != "right":
        raise HttpError(422, f"truncation_direction: {direction!r} is not supported; Fern truncates at the end "
                             "of the document (\"right\")", param="truncation_direction")
    return RerankParams(
        query=_query(payload), documents=_documents(payload, "texts", max_documents, objects=False),
        model=get_str(payload, "model"), top_n=_top_n(payload),
        raw_scores=bool(get_bool(payload, "raw_scores", False)),
        return_documents=bool(get_bool(payload, "return_text", False)),
        truncate=bool(get_bool(payload, "truncate", False)), lane=get_lane(payload, lane_header))


def tei_response(result: RerankResult) -> list[dict]:
    """TEI's /rerank body: [{"index", "score", "text"?}], best first."""
    out = [{"index": i, "score": s} for i, s in zip(result.indices.tolist(), result.scores.tolist())]
    if result.documents is not None:
        for item, text in zip(out, result.documents):
            item["text"] = text
    return out


def parse_cohere(payload: dict, lane_header: str | None, max_documents: int) -> RerankParams:
    """The gateway's params for a Cohere / Jina /v1/rerank (or Cohere /v2/rerank) request."""
    _unsupported(payload, "max_chunks_per_doc", "max_tokens_per_doc")
    fields = payload.get("rank_fields")
    if fields is not None and fields != ["text"]:
        raise HttpError(400, f"rank_fields: {fields!r} is not supported; Fern ranks each document's \"text\"",
                        param="rank_fields", code="unsupported")
    return RerankParams(
        query=_query(payload), documents=_documents(payload, "documents", max_documents, objects=True),
        model=get_str(payload, "model"), top_n=_top_n(payload),
        raw_scores=bool(get_bool(payload, "raw_scores", False)),
        return_documents=bool(get_bool(payload, "return_documents", False)),
        truncate=bool(get_bool(payload, "truncate", True)), lane=get_lane(payload, lane_header))


def cohere_response(result: RerankResult, version: str) -> dict:
    """Cohere's rerank body (Jina's is the same shape): results best first, `meta` as Cohere sends it."""
    results = [{"index": i, "relevance_score": s} for i, s in zip(result.indices.tolist(), result.scores.tolist())]
    if result.documents is not None:
        for item, text in zip(results, result.documents):
            item["document"] = {"text": text}
    tokens = int(sum(result.token_counts))
    return {"id": str(uuid.uuid4()), "model": result.model, "results": results,
            "meta": {"api_version": {"version": version}, "billed_units": {"search_units": 1}},
            "usage": {"total_tokens": tokens}}
