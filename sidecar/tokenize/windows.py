"""Cutting a long text into windows whose ids, joined, are the whole text's, so only what is kept is tokenized."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

from sidecar.tokenize.rust import fixed_specials

# A text longer than this many characters is tokenized a window at a time (LONG_WINDOW_CHARS
# each) and only as far as the result needs: truncation keeps the first tokens, a refusal needs
# only to know the limit is passed, a sparse vector counts at most SPARSE_MAX_TOKENS. Tokenizing
# a huge text whole would build Encodings for millions of tokens just to keep a few hundred.
LONG_TEXT_CHARS = 65536
LONG_WINDOW_CHARS = 16384
# The tokens a sparse vector counts: a text's first 8,192 (32 times the dense limit of a
# 256-token model), so that one huge text cannot make the sidecar hold millions of ids.
SPARSE_MAX_TOKENS = 8192
# Where a BERT tokenizer's words break whatever surrounds them: whitespace, ASCII punctuation and
# the CJK ideographs it spaces out. A cut just before one changes no token on either side.
_BERT_BREAK = re.compile(r"[\s!-/:-@\[-`{-~\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


class Windows:
    """How a BERT tokenizer's long text is cut into windows whose ids, joined, are the text's.

    A BertNormalizer works a character at a time (NFD and accent stripping never reach across a
    space or a punctuation mark, which are starters) and a BertPreTokenizer splits words at
    whitespace, punctuation and CJK ideographs, which WordPiece then takes one at a time; so a
    cut just before such a character (`cut`) changes no token, unless it falls inside an added
    token typed in the text ("[CLS]" holds punctuation), which `cut` steps over. `prefix` and
    `suffix` are the special tokens the post-processor puts around a text's ids.
    """

    def __init__(self, prefix: list[int], suffix: list[int], added: list[str]) -> None:
        self.prefix, self.suffix = prefix, suffix
        self.specials = len(prefix) + len(suffix)
        self._added = [a for a in added if a]
        self._reach = max((len(a) for a in self._added), default=0)

    @staticmethod
    def of(tokenizer: Tokenizer) -> "Windows | None":
        """The windows of `tokenizer`, or None unless it is a BERT pipeline (where cuts are proven
        not to change ids) whose post-processor puts fixed tokens around the text's ids."""
        config = json.loads(tokenizer.to_str())
        normalizer = (config.get("normalizer") or {}).get("type")
        pre = (config.get("pre_tokenizer") or {}).get("type")
        if normalizer not in (None, "BertNormalizer") or pre != "BertPreTokenizer":
            return None
        if config.get("truncation") or config.get("padding"):
            return None
        around = fixed_specials(tokenizer)
        if around is None:
            return None
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        return Windows(around[0], around[1], added)

    def cut(self, text: str, at: int) -> int:
        """The first safe cut in `text` at or after `at` (len(text) when there is none)."""
        while at < len(text):
            found = _BERT_BREAK.search(text, at)
            if found is None:
                return len(text)
            at = found.start()
            if at > 0 and not self._inside_added(text, at):
                return at
            at += 1
        return len(text)

    def _inside_added(self, text: str, at: int) -> bool:
        if not self._reach:
            return False
        near = text[max(0, at - self._reach):at + self._reach].lower()
        offset = max(0, at - self._reach)
        for added in self._added:
            pos = near.find(added.lower())
            while pos != -1:
                if offset + pos < at < offset + pos + len(added):
                    return True
                pos = near.find(added.lower(), pos + 1)
        return False
