"""The sparse encoder a request gets: BM25's query form for prompt "query", its document form otherwise."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sidecar.errors import EmbedError
from sidecar.gateway import EmbedParams, Gateway
from sidecar.lexical import Analyzer, UnknownLanguage, term_index
from sidecar.sparse import is_query, sparse_vectors


def test_query_form_has_each_term_once_with_weight_one():
    (indices, values), = sparse_vectors(["cats and dogs and cats"], language="english", query=True)
    assert indices.tolist() == sorted({term_index("cat"), term_index("dog")})
    assert values.tolist() == [1.0, 1.0]


def test_document_form_is_bm25_term_frequency():
    (indices, values), = sparse_vectors(["cats and dogs and cats"], language="english", query=False)
    want = Analyzer.of("english").document("cats and dogs and cats")
    np.testing.assert_array_equal(indices, want[0])
    np.testing.assert_array_equal(values, want[1])
    assert values[indices.tolist().index(term_index("cat"))] > values[indices.tolist().index(term_index("dog"))]


def test_only_the_query_prompt_marks_a_query():
    assert is_query("query") and not is_query("") and not is_query("passage")


def test_language_changes_stopwords_and_stemmer():
    english, = sparse_vectors(["die Katzen"], language="english", query=True)
    german, = sparse_vectors(["die Katzen"], language="german", query=True)
    assert german[0].tolist() == [term_index("katz")]
    assert term_index("die") in english[0].tolist()


@pytest.fixture(scope="module")
def registry():
    from sidecar.registry import ModelSource, Registry

    reg = Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1)
    yield reg
    reg.close()


def test_gateway_answers_sparse_alone_in_the_requested_language(registry):
    async def run():
        await registry.start()
        gateway = Gateway(registry, sparse_language="german")
        got = await gateway.embed(EmbedParams(texts=["die Katzen"], return_sparse=True, dense=False,
                                              prompt_name="query"))
        assert got.sparse[0][0].tolist() == [term_index("katz")]
        english = await gateway.embed(EmbedParams(texts=["die Katzen"], return_sparse=True, dense=False,
                                                  sparse_language="english"))
        assert term_index("die") in english.sparse[0][0].tolist()
        with pytest.raises(EmbedError, match=r"sparse_language: 'elvish' is not a language of the BM25"):
            await gateway.embed(EmbedParams(texts=["x"], return_sparse=True, sparse_language="elvish"))
        await registry.drain()
    asyncio.run(run())


def test_gateway_refuses_an_unknown_default_language(registry):
    with pytest.raises(UnknownLanguage, match="'xx'"):
        Gateway(registry, sparse_language="xx")
