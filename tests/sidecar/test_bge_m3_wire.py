"""BGE-M3's learned sparse and multi-vector outputs through `fern serve`: gRPC (unary, tokens, stream), ListModels, TEI's HTTP door."""

from __future__ import annotations

import json
import urllib.request

import grpc
import numpy as np
import pytest

from sidecar.client import FernClient, FernError
from sidecar.lexical import Analyzer
from sidecar.wire import embedder_pb2 as pb
from sidecar.client import decode_response
from tests.bge_m3_checkpoint import build_bge_m3, m3_reference, xlmr_tokenizer

TEXTS = ["Hello, world!", "the quick brown fox jumps over the lazy dog", "a",
         "vector search with late interaction retrieval in qdrant " * 4, "東京 café 2024"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return build_bge_m3(tmp_path_factory.mktemp("m3-wire") / "bge-m3", seed=21)


@pytest.fixture(scope="module")
def served(sidecar_factory, checkpoint):
    process = sidecar_factory("--model", "default", "--model", f"bge-m3={checkpoint.path}", "--http-port", "0")
    yield process
    process.stop()


@pytest.fixture
def fern(served):
    with FernClient(served.target, timeout=120) as client:
        yield client


def reference(checkpoint, texts):
    tokenizer = xlmr_tokenizer()
    ids = [tokenizer.encode(t).ids for t in texts]
    return ids, m3_reference(checkpoint, ids)


def assert_sparse(sparse, ref) -> None:
    assert sparse.indices.tolist() == sorted(ref.sparse)
    np.testing.assert_allclose(sparse.values, [ref.sparse[t] for t in sorted(ref.sparse)], atol=1e-4)


def test_list_models_says_which_outputs_each_model_offers(fern) -> None:
    models = {m.name: m for m in fern.list_models()}
    m3, minilm = models["bge-m3"], models["all-MiniLM-L6-v2"]
    assert (m3.learned_sparse, m3.multivector_dimensions, m3.outputs) == (True, 64, ("dense", "sparse", "multivector"))
    assert (minilm.learned_sparse, minilm.multivector_dimensions, minilm.outputs) == (False, 0, ("dense", "sparse"))


def test_one_call_returns_dense_learned_sparse_and_multivectors_of_the_reference(fern, checkpoint) -> None:
    ids, refs = reference(checkpoint, TEXTS)
    got = fern.embed(TEXTS, model="bge-m3", sparse=True, multivector=True)
    assert got.token_counts.tolist() == [len(s) for s in ids]
    np.testing.assert_allclose(got.vectors, np.stack([r.dense.numpy() for r in refs]), atol=1e-4)
    for sparse, ref in zip(got.sparse, refs):
        assert_sparse(sparse, ref)
    assert len(got.multivectors) == len(TEXTS)
    for vectors, ref, n in zip(got.multivectors, refs, got.token_counts):
        assert vectors.shape == (n - 1, 64) and vectors.dtype == np.float32
        np.testing.assert_allclose(vectors, ref.colbert.numpy(), atol=1e-4)
    # Not the BM25 vector a model without a learned head gets: the head's weights over token ids.
    bm25 = Analyzer.of().document(TEXTS[1])
    assert got.sparse[1].indices.tolist() != bm25[0].tolist()
    assert set(got.sparse[1].indices.tolist()) <= set(xlmr_tokenizer().encode(TEXTS[1]).ids)


def test_each_output_alone_and_none_unasked(fern, checkpoint) -> None:
    ids, refs = reference(checkpoint, TEXTS[:2])
    dense = fern.embed(TEXTS[:2], model="bge-m3")
    assert dense.sparse is None and dense.multivectors is None
    only_multi = fern.embed(TEXTS[:2], model="bge-m3", multivector=True)
    assert only_multi.sparse is None
    np.testing.assert_allclose(only_multi.vectors, dense.vectors, atol=1e-5)
    np.testing.assert_allclose(only_multi.multivectors[1], refs[1].colbert.numpy(), atol=1e-4)
    only_sparse = fern.embed(TEXTS[:2], model="bge-m3", sparse=True, encoding="float16", dimensions=16)
    assert only_sparse.multivectors is None and only_sparse.vectors.shape == (2, 16)
    assert_sparse(only_sparse.sparse[0], refs[0])


def test_token_ids_and_streams_carry_them_too(fern, checkpoint) -> None:
    ids, refs = reference(checkpoint, TEXTS)
    got = fern.embed_tokens(ids, model="bge-m3", sparse=True, multivector=True)
    for sparse, vectors, ref in zip(got.sparse, got.multivectors, refs):
        assert_sparse(sparse, ref)
        np.testing.assert_allclose(vectors, ref.colbert.numpy(), atol=1e-4)
    results = list(fern.embed_stream([("a", TEXTS[:3]), ("b", TEXTS[3:])], model="bge-m3", multivector=True,
                                     sparse=True))
    by_id = {r.request_id: r.embeddings for r in results}
    streamed = by_id["a"].multivectors + by_id["b"].multivectors
    for vectors, ref in zip(streamed, refs):
        np.testing.assert_allclose(vectors, ref.colbert.numpy(), atol=1e-4)


def test_a_request_of_many_chunks_keeps_every_texts_own_outputs(fern, checkpoint) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(300)]  # two scheduler chunks, work off the loop
    got = fern.embed(texts, model="bge-m3", sparse=True, multivector=True, lane="batch")
    ids, refs = reference(checkpoint, texts[-3:])
    for k, ref in enumerate(refs):
        assert_sparse(got.sparse[297 + k], ref)
        np.testing.assert_allclose(got.multivectors[297 + k], ref.colbert.numpy(), atol=1e-4)
    assert [len(m) for m in got.multivectors] == (got.token_counts - 1).tolist()


def test_multivectors_from_a_model_without_a_colbert_head_are_refused_naming_it(fern) -> None:
    with pytest.raises(FernError) as refused:
        fern.embed(["hello"], multivector=True)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'all-MiniLM-L6-v2' has no multi-vector (ColBERT) head" in refused.value.message
    # The model without a learned head keeps its BM25 lexical sparse vectors.
    bm25 = fern.embed(["hello hello world"], sparse=True).sparse[0]
    want = Analyzer.of().document("hello hello world")
    assert bm25.indices.tolist() == want[0].tolist()
    assert bm25.values.tolist() == pytest.approx(want[1].tolist())


def test_tei_embed_sparse_returns_the_learned_weights(served, checkpoint) -> None:
    ids, refs = reference(checkpoint, TEXTS[:2])
    request = urllib.request.Request(served.http_url + "/embed_sparse", method="POST",
                                     data=json.dumps({"inputs": TEXTS[:2], "model": "bge-m3"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.loads(response.read())
    for entries, ref in zip(body, refs):
        assert [e["index"] for e in entries] == sorted(ref.sparse)
        np.testing.assert_allclose([e["value"] for e in entries], [ref.sparse[t] for t in sorted(ref.sparse)],
                                   atol=1e-4)


def test_decode_splits_the_packed_buffer_by_count_and_checks_it() -> None:
    rows = np.arange(12, dtype="<f4").reshape(6, 2)
    resp = pb.EmbedResponse(count=3, dimensions=0, multivectors=rows.tobytes(), multivector_counts=[1, 0, 5],
                            multivector_dimensions=2, vectors=b"")
    first, empty, last = decode_response(resp).multivectors
    assert first.tolist() == [[0, 1]] and empty.shape == (0, 2) and last.tolist() == rows[1:].tolist()
    resp.multivector_counts[2] = 4
    with pytest.raises(ValueError, match="add up to 5 rows, the buffer holds 6"):
        decode_response(resp)
