"""A reranker's pair tokenization: (query, document) into one sequence with the model's separators and token types.

The checkpoint's tokenizer.json post-processor decides the layout where it has a pair
template (BERT: ``[CLS] q [SEP] d [SEP]`` with token types 0 then 1; XLM-R:
``<s> q </s></s> d </s>``, all type 0); where it has none, the family's layout is set up
from its special tokens. A type-1 token enters the engine as ``id + vocab_size`` (see
core_engine.models.bert.BertScorer), so a pair is one plain list of ints like any other
sequence. Only the document is ever cut: a query that leaves no room for a document
token is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from core_engine.config import ModelSpec
from sidecar.errors import invalid_argument
from sidecar.tokenize import rust

# Each family's layout, for a tokenizer.json without a pair template: (first, second) special tokens.
_LAYOUTS = {
    "bert": ("[CLS]", "[SEP]", "[CLS] $A:0 [SEP]:0", "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1"),
    "xlm-roberta": ("<s>", "</s>", "<s> $A:0 </s>:0", "<s>:0 $A:0 </s>:0 </s>:0 $B:0 </s>:0"),
}


def _with_pair_template(tokenizer: Tokenizer, family: str, path: Path) -> Tokenizer:
    """`tokenizer`, given the family's pair layout when its post-processor adds no special tokens to a pair."""
    if tokenizer.num_special_tokens_to_add(True) > 0:
        return tokenizer
    first, second, single, pair = _LAYOUTS[family]
    ids = {token: tokenizer.token_to_id(token) for token in (first, second)}
    missing = [token for token, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"{path}: has no pair template and no {' or '.join(missing)} token to build the "
                         f"{family} cross-encoder layout from")
    tokenizer.post_processor = TemplateProcessing(single=single, pair=pair,
                                                  special_tokens=[(t, i) for t, i in ids.items()])
    return tokenizer


class PairTokenizer:
    """One reranker's pairs: `encode(query, documents, truncate)` gives the engine's sequences.

    Thread-safe: the Rust encoder is called with no state of this object changing.
    """

    def __init__(self, tokenizer_path: str | Path, family: str, max_tokens: int, vocab_size: int,
                 token_types: int) -> None:
        path = Path(tokenizer_path)
        if family not in _LAYOUTS:
            raise ValueError(f"{family} models have no cross-encoder pair layout in Fern")
        self.max_tokens = int(max_tokens)
        self.vocab_size = int(vocab_size)
        self.token_types = int(token_types)
        self._full = _with_pair_template(rust.load(path), family, path)
        self._cut = _with_pair_template(rust.load(path), family, path)
        self._cut.enable_truncation(self.max_tokens, strategy="only_second")
        self.pair_specials = self._full.num_special_tokens_to_add(True)

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> "PairTokenizer":
        """The pair tokenizer of a reranker's ModelSpec."""
        return cls(spec.tokenizer_path, spec.family, spec.max_tokens, spec.vocab_size, spec.token_types)

    def query_tokens(self, query: str) -> int:
        """Tokens of the query alone, without special tokens."""
        return len(self._full.encode(query, add_special_tokens=False).ids)

    def encode(self, query: str, documents: Sequence[str], truncate: bool = True) -> list[list[int]]:
        """One sequence per document: the pair's ids, type-1 tokens at ``id + vocab_size``.

        `truncate`: cut each document's end to fit max_tokens; otherwise a pair over the limit
        is refused (INVALID_ARGUMENT naming ``documents[i]``). A query too long for any document
        is refused either way (``query: ...``).
        """
        room = self.max_tokens - self.pair_specials - self.query_tokens(query)
        if room < 1:
            raise invalid_argument(
                f"query: {self.max_tokens - room - self.pair_specials} tokens leaves no room for a document "
                f"within the model's limit of {self.max_tokens} tokens ({self.pair_specials} go to separators); "
                "only documents are truncated, so shorten the query")
        pairs = [(query, document) for document in documents]
        encodings = (self._cut if truncate else self._full).encode_batch(pairs)
        sequences = []
        for i, encoding in enumerate(encodings):
            ids = encoding.ids
            if len(ids) > self.max_tokens:
                raise invalid_argument(
                    f"documents[{i}]: {len(ids)} tokens with the query exceeds the model's limit of "
                    f"{self.max_tokens} tokens (truncation is TRUNCATION_ERROR)", i)
            if self.token_types > 1:
                ids = (np.asarray(ids, dtype=np.int64)
                       + self.vocab_size * np.asarray(encoding.type_ids, dtype=np.int64)).tolist()
            sequences.append(ids)
        return sequences
