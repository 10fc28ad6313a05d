"""BM25 lexical sparse vectors, term for term as Qdrant's built-in BM25 (`qdrant/bm25`) makes them.

A text is split into words at every character that is neither alphabetic nor numeric
(Unicode's Alphabetic property and the N categories, as Rust's `char::is_alphanumeric`),
each word is lowercased, dropped if it is a stopword of the language, and stemmed with the
language's Snowball stemmer. A term's index is its MurmurHash3 (32-bit, seed 0) read as a
signed integer, made positive, and folded below 10^9:

    index = |murmur3_32(term)| mod 1,000,000,000

Qdrant's and FastEmbed's BM25 stop at the absolute value; the fold keeps every index valid
in a pgvector `sparsevec(1000000000)` (pgvector's largest), so the same vectors fit both
databases. A document's value for a term is BM25's saturated term frequency

    tf * (k + 1) / (tf + k * (1 - b + b * len / avg_len))

with `len` the document's term count after stopwords are dropped, and k = 1.2, b = 0.75,
avg_len = 256 as in Qdrant. A query's vector has each distinct term once with value 1.0.
The inverse document frequency is the database's part: Qdrant's `Modifier.IDF` on the
sparse vector turns the dot product into the BM25 score.

A document counts at most MAX_TERMS terms (its first ones), which bounds what one huge
text costs; documents of up to that many words get exactly Qdrant's vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import mmh3
import numpy as np
import regex
from py_rust_stemmers import SnowballStemmer

DEFAULT_LANGUAGE = "english"
# Languages with both a Snowball stemmer and a stop list (sidecar/stopwords/).
LANGUAGES = ("danish", "dutch", "english", "finnish", "french", "german", "hungarian", "italian",
             "norwegian", "portuguese", "russian", "spanish", "swedish", "turkish")
K = 1.2
B = 0.75
AVG_LEN = 256.0
INDEX_SPACE = 1_000_000_000  # pgvector's largest sparsevec dimension
MAX_TERMS = 8192
# Words up to this many characters are remembered (their index); longer ones are rare and
# would let the cache hold arbitrarily much text.
CACHED_WORD_CHARS = 64

_WORDS = regex.compile(r"[\p{Alphabetic}\p{N}]+")


@dataclass(frozen=True)
class Bm25Params:
    """BM25's constants: term-frequency saturation `k`, length normalization `b`, and the
    assumed average document length `avg_len` in terms."""

    k: float = K
    b: float = B
    avg_len: float = AVG_LEN


class UnknownLanguage(ValueError):
    """A language the lexical analyzer has no stemmer and stop list for."""

    def __init__(self, language: str) -> None:
        super().__init__(f"{language!r} is not a language of the BM25 sparse vectors "
                         f"(known: {', '.join(LANGUAGES)})")
        self.language = language


def check_language(language: str) -> str:
    """`language` lowercased, or UnknownLanguage naming it and the known ones."""
    name = language.strip().lower()
    if name not in LANGUAGES:
        raise UnknownLanguage(language)
    return name


def stopwords(language: str) -> frozenset[str]:
    """The stop list of a language (Snowball's, as NLTK's stopwords corpus amends it)."""
    text = resources.files("sidecar").joinpath("stopwords", f"{check_language(language)}.txt").read_text("utf-8")
    return frozenset(w for w in text.splitlines() if w)


def term_index(term: str) -> int:
    """A term's sparse index: |murmur3_32(term, seed 0) as int32| mod INDEX_SPACE."""
    return abs(mmh3.hash(term)) % INDEX_SPACE


class Analyzer:
    """One language's text-to-terms pipeline and the BM25 vectors built from it.

    `Analyzer.of(language)` shares one analyzer a language; it is safe to use from several
    threads (the caches are lru_cache, the stemmer holds no state between words).
    """

    def __init__(self, language: str = DEFAULT_LANGUAGE, params: Bm25Params = Bm25Params()) -> None:
        self.language = check_language(language)
        self.params = params
        self._stop = stopwords(self.language)
        self._stemmer = SnowballStemmer(self.language)
        self._cached_index = lru_cache(maxsize=1 << 16)(self._index_of_word)

    @staticmethod
    @lru_cache(maxsize=None)
    def of(language: str = DEFAULT_LANGUAGE) -> "Analyzer":
        return Analyzer(language)

    def terms(self, text: str, limit: int = MAX_TERMS) -> list[str]:
        """The text's terms in order: words, lowercased, stopwords dropped, stemmed."""
        out = []
        for match in _WORDS.finditer(text):
            word = match.group().lower()
            if word in self._stop:
                continue
            out.append(self._stemmer.stem_word(word))
            if len(out) >= limit:
                break
        return out

    def _index_of_word(self, word: str) -> int:
        """The index of a word already lowercased, or -1 for a stopword."""
        if word in self._stop:
            return -1
        return term_index(self._stemmer.stem_word(word))

    def _indices(self, text: str, limit: int) -> list[int]:
        out = []
        cached, uncached = self._cached_index, self._index_of_word
        for match in _WORDS.finditer(text):
            word = match.group().lower()
            index = cached(word) if len(word) <= CACHED_WORD_CHARS else uncached(word)
            if index >= 0:
                out.append(index)
                if len(out) >= limit:
                    break
        return out

    def document(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """A document's vector: (indices uint32 ascending, BM25 term-frequency values float32)."""
        indices = np.asarray(self._indices(text, MAX_TERMS), dtype=np.int64)
        if indices.size == 0:
            return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.float32)
        unique, tf = np.unique(indices, return_counts=True)
        p = self.params
        tf = tf.astype(np.float64)
        values = tf * (p.k + 1.0) / (tf + p.k * (1.0 - p.b + p.b * indices.size / p.avg_len))
        return unique.astype(np.uint32), values.astype(np.float32)

    def query(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """A query's vector: each distinct term once (indices ascending), value 1.0."""
        unique = np.unique(np.asarray(self._indices(text, MAX_TERMS), dtype=np.int64))
        return unique.astype(np.uint32), np.ones(unique.size, dtype=np.float32)
