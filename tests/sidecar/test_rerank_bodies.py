"""The rerank HTTP bodies (TEI's and Cohere's) read into the gateway's params, and refused naming the field."""

from __future__ import annotations

import pytest

from core_engine.config import load_spec
from sidecar.http import rerank_api, tei_api
from sidecar.http.errors import HttpError
from sidecar.lanes import Lane


def test_tei_body_defaults_follow_tei() -> None:
    params = rerank_api.parse_tei({"query": "q", "texts": ["a", "b"]}, None, 1000)
    assert (params.query, list(params.documents), params.raw_scores, params.return_documents, params.truncate) == \
        ("q", ["a", "b"], False, False, False)
    assert params.lane is Lane.ONLINE and params.top_n == 0 and params.model == ""


def test_cohere_body_takes_text_objects_and_truncates_by_default() -> None:
    params = rerank_api.parse_cohere({"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1,
                                      "return_documents": True}, "batch", 1000)
    assert (list(params.documents), params.top_n, params.return_documents, params.truncate, params.lane) == \
        (["a", "b"], 1, True, True, Lane.BATCH)


@pytest.mark.parametrize(("parse", "body", "status", "message"), [
    (rerank_api.parse_tei, {"texts": ["a"]}, 400, "query: missing"),
    (rerank_api.parse_tei, {"query": 3, "texts": ["a"]}, 400, "query: expected a string, got a number"),
    (rerank_api.parse_tei, {"query": "q", "texts": "a"}, 400, "texts: expected a list of strings, got a string"),
    (rerank_api.parse_tei, {"query": "q", "texts": []}, 400, "texts: an empty list"),
    (rerank_api.parse_tei, {"query": "q", "texts": ["a", 1]}, 400, r"texts\[1\]: expected a string, got a number"),
    (rerank_api.parse_tei, {"query": "q", "texts": ["a"] * 3}, 413, "texts: 3 documents exceeds the limit of 2"),
    (rerank_api.parse_tei, {"query": "q", "texts": ["a"], "truncation_direction": "left"}, 422,
     "truncation_direction: 'left' is not supported"),
    (rerank_api.parse_cohere, {"query": "q", "documents": [{"title": "x"}]}, 400,
     r'documents\[0\]: expected a string or an object with a "text" string, got an object'),
    (rerank_api.parse_cohere, {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n: expected a positive"),
    (rerank_api.parse_cohere, {"query": "q", "documents": ["a"], "rank_fields": ["title"]}, 400,
     "rank_fields: .* is not supported"),
    (rerank_api.parse_cohere, {"query": "q", "documents": ["a"], "max_chunks_per_doc": 4}, 400,
     "max_chunks_per_doc: not supported"),
])
def test_bad_bodies_are_refused_naming_the_field(parse, body, status, message) -> None:
    with pytest.raises(HttpError, match=message) as refused:
        parse(body, None, 2)
    assert refused.value.status == status


def test_tei_info_describes_a_reranker_by_its_labels(tmp_path) -> None:
    from benchmarks.models import build_random_reranker

    spec = load_spec(build_random_reranker("bert", tmp_path / "rr", seed=1))
    info = tei_api.info(spec, 8, 1024)
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
