"""BM25 lexical vectors held term for term to Qdrant's own BM25 (qdrant-edge's, compiled from Qdrant's Rust)."""

from __future__ import annotations

import numpy as np
import pydoc_data.topics
import pytest
import qdrant_edge

from sidecar.lexical import (B, INDEX_SPACE, K, LANGUAGES, MAX_TERMS, Analyzer, Bm25Params,
                             UnknownLanguage, check_language, stopwords, term_index)

# Texts no one chose for Fern: CPython's own reference topics, plus the corners of word splitting.
CORPUS = sorted(pydoc_data.topics.topics.values())[:120] + [
    "The quick brown foxes are jumping over the lazy dogs!",
    "Hello, WORLD: it's naïve café 123 x_y foo-bar don't we'll",
    "snake_case, CamelCase, kebab-case, dotted.name, a/b\\c, 3.14159, 1e-9, ½ ⅔ ² Ⅻ",
    "ΟΔΟΣ οδός Straße STRASSE İstanbul ǅemal ﬁnance",
    "हिन्दी में पाठ, தமிழ் உரை, 東京タワー 😀 emoji👍mixed",
    "e\u0301t\u0301e\u0301 (decomposed accents)  tab\tnew\nline\u00a0nbsp\u200bzero-width",
    "word " * 300,
    "a an the of to in",
]

SENTENCES = {
    "danish": "Katten sad på måtten og sang om de gamle huse ved havet",
    "dutch": "De katten liepen snel over de straten en zongen liedjes",
    "english": "The cats were running quickly through the streets and singing songs",
    "finnish": "Kissat juoksivat nopeasti kaduilla ja lauloivat lauluja",
    "french": "Les chats couraient rapidement dans les rues et chantaient des chansons",
    "german": "Die Katzen liefen schnell über die Straßen und sangen Lieder, dass unsere Häuser",
    "hungarian": "A macskák gyorsan futottak az utcákon és dalokat énekeltek, õ elõtt",
    "italian": "I gatti correvano velocemente per le strade e cantavano canzoni",
    "norwegian": "Kattene løp raskt gjennom gatene og sang sanger",
    "portuguese": "Os gatos corriam rapidamente pelas ruas e cantavam canções, é estar ser",
    "russian": "Кошки быстро бежали по улицам и пели песни",
    "spanish": "Los gatos corrían rápidamente por las calles y cantaban canciones, vosotros",
    "swedish": "Katterna sprang snabbt genom gatorna och sjöng sånger",
    "turkish": "Kediler sokaklarda hızla koşuyor ve şarkılar söylüyorlardı",
}


def reference(language: str) -> qdrant_edge.Bm25:
    return qdrant_edge.Bm25(qdrant_edge.Bm25Config(language=language))


def folded(vector) -> dict[int, float]:
    """A Qdrant sparse vector with its indices folded into Fern's index space."""
    out: dict[int, float] = {}
    for index, value in zip(vector.indices, vector.values):
        assert index % INDEX_SPACE not in out, "two terms share an index after the fold"
        out[index % INDEX_SPACE] = value
    return out


def assert_same(ours: tuple[np.ndarray, np.ndarray], theirs, text: str) -> None:
    indices, values = ours
    assert indices.dtype == np.uint32 and values.dtype == np.float32
    assert (np.diff(indices.astype(np.int64)) > 0).all(), "indices ascending and distinct"
    want = folded(theirs)
    assert set(indices.tolist()) == set(want), f"terms differ for {text[:60]!r}"
    np.testing.assert_allclose(values, [want[i] for i in indices.tolist()], rtol=1e-6,
                               err_msg=f"weights differ for {text[:60]!r}")


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_english_documents_and_queries_match_qdrant_term_for_term(text):
    ours, theirs = Analyzer.of("english"), reference("english")
    assert_same(ours.document(text), theirs.embed_document(text), text)
    assert_same(ours.query(text), theirs.embed_query(text), text)


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_language_matches_qdrant_on_its_stopwords_and_a_sentence(language):
    # Every stopword of ours is one of Qdrant's (else its term would be in Qdrant's vector),
    # and every word Qdrant drops is dropped here (else ours would have it).
    text = " ".join(sorted(stopwords(language))) + ". " + SENTENCES[language]
    ours, theirs = Analyzer(language), reference(language)
    assert_same(ours.document(text), theirs.embed_document(text), text)
    assert_same(ours.document(SENTENCES[language]), theirs.embed_document(SENTENCES[language]),
                SENTENCES[language])
    assert ours.document(" ".join(stopwords(language)))[0].size == 0


def test_stopwords_are_dropped_and_words_stemmed():
    terms = Analyzer.of("english").terms("The Running of the Bulls, and the runner runs")
    assert terms == ["run", "bull", "runner", "run"]


def test_weights_follow_the_bm25_formula_by_hand():
    indices, values = Analyzer.of().document("cat cat cat dog dog bird")
    n = 6
    by_index = dict(zip(indices.tolist(), values.tolist()))
    for term, tf in (("cat", 3), ("dog", 2), ("bird", 1)):
        expected = tf * (K + 1) / (tf + K * (1 - B + B * n / 256.0))
        assert by_index[term_index(term)] == pytest.approx(expected, rel=1e-6)
    flat = Analyzer("english", Bm25Params(k=0.0)).document("cat cat dog")
    np.testing.assert_allclose(flat[1], [1.0, 1.0])  # k = 0: presence alone


def test_indices_fit_a_pgvector_sparsevec():
    indices = np.concatenate([Analyzer.of().document(t)[0] for t in CORPUS])
    assert indices.size > 1000 and int(indices.max()) < INDEX_SPACE == 1_000_000_000


def test_a_huge_document_counts_its_first_max_terms_terms():
    text = " ".join(f"w{i}" for i in range(MAX_TERMS)) + " overflow" * 1000
    indices, _ = Analyzer.of().document(text)
    assert indices.size == MAX_TERMS and term_index("overflow") not in set(indices.tolist())
    long_word = "x" * 100_000  # longer than any cached word; one term all the same
    assert Analyzer.of().document(long_word + " " + long_word)[0].size == 1


def test_empty_and_stopword_only_texts_give_empty_vectors():
    for text in ("", "   ", "the of and", "!!! ---"):
        indices, values = Analyzer.of().document(text)
        assert indices.size == 0 and values.size == 0
        assert Analyzer.of().query(text)[0].size == 0


def test_unknown_language_is_refused_by_name_with_the_known_ones():
    with pytest.raises(UnknownLanguage, match=r"'klingon' is not a language of the BM25 sparse "
                                              r"vectors \(known: danish, dutch, english"):
        Analyzer("klingon")
    with pytest.raises(UnknownLanguage, match="'japanese'"):
        stopwords("japanese")
    assert check_language(" English ") == "english"
