"""Splitting long text into overlapping chunks sized in tokens, without a tokenizer.

The adapter has no tokenizer (it runs on a database host with only the sidecar's client),
so chunks are cut at word boundaries using a conservative words-per-token estimate, and the
sidecar's exact `token_counts` are the check: a chunk that came back at the model's limit
was cut by the sidecar, so the worker splits it in two and embeds the halves (see
`split_in_half`). No text is silently lost, and chunks stay close to the size asked for.
Asking the sidecar to tokenize first would cost a second round trip for every row.
"""

from __future__ import annotations

import re

# WordPiece/BPE vocabularies of English-trained models average ~1.3 tokens per word;
# 1.5 leaves room for numbers, names and punctuation. Other scripts are caught by the
# token_counts check.
TOKENS_PER_WORD = 1.5
# [CLS]/[SEP] or BOS/EOS, plus a prompt's few tokens.
SPECIAL_TOKENS = 4
_WORD = re.compile(r"\S+\s*")


def _words(text: str, max_chars: int) -> list[str]:
    """Words with their trailing whitespace; a "word" longer than max_chars is cut."""
    words: list[str] = []
    for m in _WORD.finditer(text):
        w = m.group(0)
        while len(w) > max_chars:
            words.append(w[:max_chars])
            w = w[max_chars:]
        words.append(w)
    return words


def split_text(text: str, chunk_tokens: int, overlap_tokens: int) -> list[str]:
    """Chunks of about `chunk_tokens` tokens, consecutive chunks sharing `overlap_tokens`."""
    budget = max(1, chunk_tokens - SPECIAL_TOKENS)
    per_chunk = max(1, int(budget / TOKENS_PER_WORD))
    overlap = min(int(overlap_tokens / TOKENS_PER_WORD), per_chunk // 2)
    words = _words(text.strip(), max_chars=budget)
    if len(words) <= per_chunk:
        return [text.strip()] if text.strip() else []
    chunks: list[str] = []
    start = 0
    while start < len(words):
        end = min(len(words), start + per_chunk)
        chunks.append("".join(words[start:end]).strip())
        if end == len(words):
            break
        start = end - overlap
    return chunks


def split_in_half(text: str) -> list[str]:
    """Two halves of a chunk the sidecar had to truncate (at a word boundary when there is one)."""
    words = _words(text, max_chars=max(1, len(text)))
    if len(words) >= 2:
        mid = len(words) // 2
        return ["".join(words[:mid]).strip(), "".join(words[mid:]).strip()]
    mid = len(text) // 2
    return [text[:mid], text[mid:]]
