"""The sparse vectors of a request's texts, for hybrid search: which encoder makes them, and how.

The gateway picks the encoder for a served model (`learned` in `Gateway.prepare`): a model
with a learned sparse head answers from that head in the engine step; every other model
gets the BM25 lexical vectors made here (sidecar/lexical.py): the same terms,
indices and weights as Qdrant's built-in BM25, with the IDF left to the database (Qdrant's
`Modifier.IDF`).

The texts are the request's own, *without* the prompt template (a "query: " prefix on
every query would match every document). A query (prompt name "query") gets BM25's query
form, each distinct term with weight 1.0; anything else the document form, saturated term
frequencies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.lexical import Analyzer

QUERY_PROMPT = "query"

SparseVector = tuple[np.ndarray, np.ndarray]


def sparse_vectors(texts: Sequence[str], *, language: str, query: bool) -> list[SparseVector]:
    """The BM25 lexical vectors of `texts`: (indices uint32 ascending, values float32) each."""
    analyzer = Analyzer.of(language)
    embed = analyzer.query if query else analyzer.document
    return [embed(text) for text in texts]


def is_query(prompt_name: str) -> bool:
    """Whether a request's prompt name marks its texts as search queries."""
    return prompt_name == QUERY_PROMPT
