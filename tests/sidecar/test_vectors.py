"""Vectors through gRPC: parity with sentence-transformers, every encoding/dimensions/normalize option, sparse."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from core_engine.config import load_spec
from core_engine.loader import default_model_dir
from sidecar.lexical import Analyzer, term_index


@pytest.fixture(scope="module")
def reference(st_model, texts):
    return st_model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)


@pytest.fixture(scope="module")
def served(sidecar_target, texts):
    from sidecar.client import FernClient

    with FernClient(sidecar_target, timeout=300) as c:
        return c.embed(texts, lane="batch")


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_parity_with_sentence_transformers_over_200_varied_texts(texts, served, reference):
    assert len(texts) >= 200 and served.vectors.shape == reference.shape
    cos = _cosine(served.vectors.astype(np.float64), reference.astype(np.float64))
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.99999, f"text {worst} {texts[worst][:60]!r}: cosine {cos[worst]:.7f}"


def test_long_texts_are_truncated_at_256_tokens(texts, served):
    counts = served.token_counts
    assert counts.max() == 256 and (counts == 256).sum() >= 8
    assert counts.min() == 3  # one word between [CLS] and [SEP]: texts with nothing to embed are refused


def test_same_text_alone_and_in_a_batch(client, texts, served):
    for i in (0, 45, 60, len(texts) - 1):
        alone = client.embed([texts[i]]).vectors[0]
        assert float(alone @ served.vectors[i]) >= 0.99999


# --------------------------------------------------------------------------- options vs numpy

SAMPLE = ["vector databases", "an embedding sidecar on the GPU", "東京", "a b c d e f g",
          "word " * 300]


@pytest.fixture(scope="module")
def raw(sidecar_target):
    from sidecar.client import FernClient

    with FernClient(sidecar_target, timeout=120) as c:
        return c.embed(SAMPLE, normalize=False).vectors.astype(np.float64)


def test_normalize_false_gives_the_raw_pooled_vector(client, raw):
    norms = np.linalg.norm(raw, axis=1)
    assert (np.abs(norms - 1) > 0.05).all()  # MiniLM's pooled vectors are not unit length
    default = client.embed(SAMPLE).vectors
    np.testing.assert_allclose(default, raw / norms[:, None], atol=2e-6)


@pytest.mark.parametrize("dims", [1, 64, 128, 383, 384])
def test_dimensions_truncate_before_normalizing(client, raw, dims):
    got = client.embed(SAMPLE, dimensions=dims)
    assert got.vectors.shape == (len(SAMPLE), dims) and got.dimensions == dims
    cut = raw[:, :dims]
    np.testing.assert_allclose(got.vectors, cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=2e-6)
    unnormalized = client.embed(SAMPLE, dimensions=dims, normalize=False).vectors
    np.testing.assert_allclose(unnormalized, cut, rtol=1e-5, atol=1e-5)


def test_float16(client, raw):
    got = client.embed(SAMPLE, encoding="float16")
    assert got.vectors.dtype == np.dtype("<f2") and got.encoding == "float16"
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(got.vectors.astype(np.float64), unit, atol=1e-3)


def test_int8_is_scaled_by_each_vectors_max(client, raw):
    got = client.embed(SAMPLE, encoding="int8", dimensions=256)
    assert got.vectors.dtype == np.int8 and got.vectors.shape == (len(SAMPLE), 256)
    cut = raw[:, :256]
    unit = cut / np.linalg.norm(cut, axis=1, keepdims=True)
    expected = np.round(127 * unit / np.abs(unit).max(axis=1, keepdims=True))
    assert np.abs(got.vectors.astype(np.int64) - expected).max() <= 1
    assert (np.abs(got.vectors).max(axis=1) == 127).all()


@pytest.mark.parametrize("dims", [384, 100])
def test_binary_packs_signs_first_component_high_bit(client, raw, dims):
    got = client.embed(SAMPLE, encoding="binary", dimensions=dims)
    assert got.vectors.dtype == np.uint8 and got.vectors.shape == (len(SAMPLE), (dims + 7) // 8)
    expected = np.packbits(raw[:, :dims] > 0, axis=1)
    # A component within float noise of 0 may flip; none should here, but allow one bit a row.
    flips = np.unpackbits(got.vectors ^ expected, axis=1).sum(axis=1)
    assert (flips <= 1).all() and flips.sum() <= 1


# --------------------------------------------------------------------------- sparse

def test_sparse_vectors_are_bm25_of_the_text_without_prompt(client):
    texts = ["the cat sat on the mat, the cat sat", "word " * 400, "東京 😀"]
    docs = client.embed(texts, sparse=True, prompt="passage")
    queries = client.embed(texts, sparse=True, prompt="query")
    analyzer = Analyzer.of("english")
    assert docs.sparse is not None and len(docs.sparse) == len(texts)
    for text, doc, query in zip(texts, docs.sparse, queries.sparse):
        indices, values = analyzer.document(text)
        np.testing.assert_array_equal(doc.indices, indices)
        np.testing.assert_allclose(doc.values, values, rtol=1e-6)
        np.testing.assert_array_equal(query.indices, indices)  # the same terms, each weighing 1
        assert (query.values == 1.0).all()
    first = dict(zip(docs.sparse[0].indices.tolist(), docs.sparse[0].values.tolist()))
    assert term_index("the") not in first  # a stopword
    assert first[term_index("cat")] > first[term_index("mat")]  # "cat" appears twice
    assert len(docs.sparse[1].indices) == 1  # one distinct term, all 400 kept (no truncation)


def test_no_sparse_unless_asked(client):
    assert client.embed(["x"]).sparse is None


def test_sparse_for_token_ids_is_bm25_of_their_decoded_words(client):
    tok = Tokenizer.from_file(str(load_spec(default_model_dir()).tokenizer_path))
    ids = tok.encode("word word hello", add_special_tokens=True).ids
    got = client.embed_tokens([ids], sparse=True)
    indices, values = Analyzer.of("english").document("word word hello")
    np.testing.assert_array_equal(got.sparse[0].indices, indices)
    np.testing.assert_allclose(got.sparse[0].values, values, rtol=1e-6)
