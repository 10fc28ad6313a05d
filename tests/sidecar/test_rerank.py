"""Reranking through `fern serve --model` of a cross-encoder directory: gRPC (both clients), TEI's /rerank and Cohere's SDK.

The reference is transformers' BertForSequenceClassification on the same random weights,
tokenized by transformers' own fast tokenizer, with sigmoid as TEI and Cohere apply it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir
from sidecar.client import AsyncFernClient, FernClient, FernError

cohere = pytest.importorskip("cohere")

TOKEN = "rerank-s3cret"
RERANKER = "tiny-reranker"
EMBEDDER = "all-MiniLM-L6-v2"
QUERY = "how do databases search vectors?"
DOCUMENTS = [
    "A vector database indexes embeddings and searches them by distance.",
    "Paris is the capital of France.",
    "Cross-encoders score a query and a document read together.",
    "ok",
    "HNSW graphs make approximate nearest-neighbour search fast. " * 4,
    "The weather was sunny all week.",
    "Rerankers reorder the top candidates of a first-stage search.",
]
LONG_DOCUMENT = "reranking documents for a query with a cross-encoder " * 40


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(21)
    hf = reranker_model(TINY_RERANKERS["bert"]).eval()
    randomize_weights(hf, 21)
    return hf, save_reranker_dir(hf, tmp_path_factory.mktemp("rerankers") / RERANKER)


@pytest.fixture(scope="module")
def served(sidecar_factory, reranker):
    """The bundled embedder (the default model) beside the reranker, with the HTTP door and a token."""
    _, path = reranker
    process = sidecar_factory("--model", "default", "--model", f"{RERANKER}={path}", "--token", TOKEN,
                              "--http-port", "0")
    yield process
    process.stop()


def _logits(hf: torch.nn.Module, path: Path, query: str, documents: list[str]) -> np.ndarray:
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    out = []
    with torch.inference_mode():
        for document in documents:
            enc = tokenizer(query, document, truncation="only_second", max_length=128, return_tensors="pt",
                            return_token_type_ids=True)
            out.append(hf(**enc).logits[0, 0].item())
    return np.asarray(out)


@pytest.fixture(scope="module")
def reference(reranker) -> np.ndarray:
    hf, path = reranker
    return _logits(hf, path, QUERY, DOCUMENTS)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture
def client(served):
    with FernClient(served.target, token=TOKEN, timeout=60) as c:
        yield c


def test_list_models_names_each_kind(client):
    kinds = {m.name: (m.kind, m.dimensions) for m in client.list_models()}
    assert kinds == {EMBEDDER: ("embedding", 384), RERANKER: ("reranker", 1)}


def test_grpc_rerank_matches_transformers_best_first(client, reference):
    assert np.ptp(reference) > 0.05, "the random weights should tell the documents apart"
    ranked = client.rerank(QUERY, DOCUMENTS)  # no model named: the default embeds, so the reranker
    assert ranked.model == RERANKER
    order = np.argsort(-reference, kind="stable")
    assert ranked.indices == order.tolist()
    np.testing.assert_allclose([r.score for r in ranked.results], _sigmoid(reference[order]), rtol=1e-4, atol=1e-5)
    assert all(r.document is None for r in ranked.results)
    assert len(ranked.token_counts) == len(DOCUMENTS)

    raw = client.rerank(QUERY, DOCUMENTS, model=RERANKER, raw_scores=True, top_n=3, return_documents=True)
    assert raw.indices == order[:3].tolist()
    np.testing.assert_allclose([r.score for r in raw.results], reference[order[:3]], rtol=1e-3, atol=1e-4)
    assert [r.document for r in raw.results] == [DOCUMENTS[i] for i in order[:3]]


def test_async_client_gives_the_same_ranking(served, client):
    async def run():
        async with AsyncFernClient(served.target, token=TOKEN, timeout=60) as c:
            return await asyncio.gather(*(c.rerank(QUERY, DOCUMENTS, top_n=k) for k in (0, 2)))

    full, top2 = asyncio.run(run())
    expected = client.rerank(QUERY, DOCUMENTS)
    assert full.indices == expected.indices and top2.indices == expected.indices[:2]
    np.testing.assert_allclose([r.score for r in full.results], [r.score for r in expected.results], atol=1e-6)


def test_long_documents_are_cut_and_the_query_kept(client, reranker):
    hf, path = reranker
    ranked = client.rerank(QUERY, ["short document", LONG_DOCUMENT], raw_scores=True)
    by_index = {r.index: r.score for r in ranked.results}
    assert ranked.token_counts[1] == 128
    ref = _logits(hf, path, QUERY, ["short document", LONG_DOCUMENT])
    np.testing.assert_allclose([by_index[0], by_index[1]], ref, rtol=1e-3, atol=1e-4)
    with pytest.raises(FernError) as refused:
        client.rerank(QUERY, ["short document", LONG_DOCUMENT], truncate=False)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.index == 1
    assert "documents[1]" in refused.value.message and "limit of 128 tokens" in refused.value.message
    with pytest.raises(FernError, match="query: .* leaves no room for a document"):
        client.rerank(LONG_DOCUMENT, ["short document"])


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.embed(["text"], model=RERANKER), f"model: '{RERANKER}' is a reranker"),
    (lambda c: c.rerank(QUERY, ["d"], model=EMBEDDER), f"model: '{EMBEDDER}' is an embedding model"),
    (lambda c: c.rerank(QUERY, []), "documents: empty list"),
    (lambda c: c.rerank(QUERY, ["d"] * 1001), "documents: 1001 documents exceeds the limit of 1000"),
    (lambda c: c.rerank("", ["d"]), "query: empty text"),
    (lambda c: c.rerank(QUERY, ["d", " \u200b "]), r"documents\[1\]: empty text"),
])
def test_refusals_are_invalid_argument_naming_the_input(client, call, message):
    with pytest.raises(FernError, match=message) as refused:
        call(client)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_embed_on_the_default_model_still_embeds(client):
    assert client.embed(["still an embedder"]).vectors.shape == (1, 384)


def test_tei_rerank_over_http(served, client):
    # huggingface_hub's InferenceClient has no rerank call (text_classification is another route),
    # so TEI's /rerank is spoken with plain httpx.
    headers = {"authorization": f"Bearer {TOKEN}"}
    expected = client.rerank(QUERY, DOCUMENTS)
    body = httpx.post(served.http_url + "/rerank", headers=headers, timeout=60,
                      json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}).json()
    assert [item["index"] for item in body] == expected.indices
    np.testing.assert_allclose([item["score"] for item in body], [r.score for r in expected.results], atol=1e-6)
    assert [item["text"] for item in body] == [DOCUMENTS[i] for i in expected.indices]
    raw = httpx.post(served.http_url + "/rerank", headers=headers, timeout=60,
                     json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}).json()
    logits = client.rerank(QUERY, DOCUMENTS, raw_scores=True)
    assert "text" not in raw[0]
    np.testing.assert_allclose([item["score"] for item in raw], [r.score for r in logits.results], atol=1e-6)
    # TEI's truncate defaults to false: a pair over the limit is a 413 naming the document.
    too_long = httpx.post(served.http_url + "/rerank", headers=headers, timeout=60,
                          json={"query": QUERY, "texts": ["a", LONG_DOCUMENT]})
    assert too_long.status_code == 413 and too_long.json()["error"].startswith("documents[1]:")
    empty = httpx.post(served.http_url + "/rerank", headers=headers, timeout=60, json={"query": QUERY, "texts": []})
    assert empty.status_code == 400 and "texts: an empty list" in empty.json()["error"]


def test_http_model_list_names_each_kind(served):
    body = httpx.get(served.http_url + "/v1/models", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60).json()
    assert {m["id"]: m["kind"] for m in body["data"]} == {EMBEDDER: "embedding", RERANKER: "reranker"}


def test_cohere_sdk_rerank_v1_and_v2(served, client):
    expected = client.rerank(QUERY, DOCUMENTS)
    co = cohere.Client(api_key=TOKEN, base_url=served.http_url, timeout=60)
    response = co.rerank(model=RERANKER, query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True)
    assert [r.index for r in response.results] == expected.indices[:3]
    np.testing.assert_allclose([r.relevance_score for r in response.results],
                               [r.score for r in expected.results[:3]], atol=1e-6)
    assert [r.document.text for r in response.results] == [DOCUMENTS[i] for i in expected.indices[:3]]

    v2 = cohere.ClientV2(api_key=TOKEN, base_url=served.http_url, timeout=60)
    response = v2.rerank(model=RERANKER, query=QUERY, documents=DOCUMENTS)
    assert [r.index for r in response.results] == expected.indices

    with pytest.raises(cohere.errors.BadRequestError) as refused:
        co.rerank(model=EMBEDDER, query=QUERY, documents=DOCUMENTS)
    assert "is an embedding model" in refused.value.body["message"]
    with pytest.raises(cohere.errors.UnauthorizedError):
        cohere.Client(api_key="wrong", base_url=served.http_url, timeout=60).rerank(
            model=RERANKER, query=QUERY, documents=DOCUMENTS)


def test_a_refused_rerank_is_logged_with_its_documents(served, client):
    import time

    with pytest.raises(FernError):
        client.rerank(QUERY, ["d"] * 1001, request_id="too-many")
    # The line is written once the status has gone out: wait for it (bounded, not timed).
    deadline = time.monotonic() + 30
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        lines = [line for line in served.log_path.read_text().splitlines() if "request_id=too-many" in line]
        time.sleep(0.05)
    assert lines and "method=Rerank" in lines[-1] and "status=INVALID_ARGUMENT" in lines[-1]
    assert "inputs=1001" in lines[-1] and "lane=online" in lines[-1]


def test_many_documents_on_the_batch_lane_keep_their_indices(client, reranker):
    # 300 documents: more than one scheduler chunk (256 inputs), scored in several steps.
    hf, path = reranker
    documents = [f"{DOCUMENTS[i % len(DOCUMENTS)]} (variant {i})" for i in range(300)]
    ranked = client.rerank(QUERY, documents, raw_scores=True, lane="batch")
    assert sorted(ranked.indices) == list(range(300))
    by_index = np.empty(300)
    for r in ranked.results:
        by_index[r.index] = r.score
    np.testing.assert_allclose(by_index, _logits(hf, path, QUERY, documents), rtol=1e-3, atol=1e-4)
