"""WordPiece in Python, for the few chunks a query's memo lacks: a few dictionary lookups beat a Rust call."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

from sidecar.tokenize.ascii import ASCII_WORDS


class WordPiece:
    """The ASCII twin's plain ids of one blank-free chunk: its regex's words, each through
    WordPiece as the `tokenizers` library runs it (greedy longest match first, "##" before
    every piece after the first, the whole word [UNK] when a piece cannot be matched or the
    word is over max_input_chars_per_word)."""

    _words = re.compile(ASCII_WORDS).findall

    def __init__(self, model: dict) -> None:
        self.vocab: dict[str, int] = model["vocab"]
        self._unk = self.vocab[model["unk_token"]]
        self._prefix = model["continuing_subword_prefix"]
        self._max_chars = model["max_input_chars_per_word"]

    @staticmethod
    def of(tokenizer: Tokenizer) -> "WordPiece | None":
        """The WordPiece of `tokenizer`'s model, or None when it is another model."""
        model = json.loads(tokenizer.to_str())["model"]
        if model.get("type") != "WordPiece" or model.get("unk_token") not in model.get("vocab", {}):
            return None
        return WordPiece(model)

    def ids(self, chunk: str) -> tuple[int, ...]:
        """The ids of `chunk` (lowercased ASCII without blanks), as the twin gives them."""
        out: list[int] = []
        for word in self._words(chunk):
            out += self._word(word)
        return tuple(out)

    def _word(self, word: str) -> list[int]:
        if len(word) > self._max_chars:
            return [self._unk]
        vocab, pieces, start = self.vocab, [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = vocab.get(word[start:end] if start == 0 else self._prefix + word[start:end])
                if piece is not None:
                    break
            else:
                return [self._unk]
            pieces.append(piece)
            start = end
        return pieces
