"""One model's tokenization, synchronous: each text down the cheapest path that gives tokenizer.json's ids.

The model's tokenizer.json is loaded with padding off (packed batches need none) and truncation
at the model's real limit (`max_tokens`, e.g. 256 for all-MiniLM-L6-v2, whose shipped file says
128). Special tokens are added by the tokenizer's own post-processor and survive truncation.
Models whose pooling reads the last token (Qwen3-Embedding) need an end-of-text token there;
when tokenizer.json does not append it (`eos_id`), it is appended here, truncating one token
earlier to make room, as the model's reference code does.

ASCII texts of a BERT tokenizer go through its twin (`AsciiTwin`), a query-sized request's from
the chunk memo (`ChunkMemo`); a batch is split between the twin and the shipped pipeline and put
back in order. Texts over LONG_TEXT_CHARS are read a window at a time (`Windows`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from sidecar.errors import invalid_argument
from sidecar.tokenize.ascii import AsciiTwin
from sidecar.tokenize.memo import MEMO_CHUNKS, ChunkMemo
from sidecar.tokenize.rust import encode_ids, load
from sidecar.tokenize.windows import LONG_TEXT_CHARS, LONG_WINDOW_CHARS, SPARSE_MAX_TOKENS, Windows

# A query this small tokenizes in tens of microseconds from the chunk memo, less than the hop to
# a worker thread and back: it is done on the event loop. 4,096 characters hold one 512-token
# passage (English runs 4-5 characters a token).
INLINE_TEXTS = 4
INLINE_CHARS = 4096


def query_sized(texts: Sequence[str]) -> bool:
    """Whether a request is tokenized on the loop, from the chunk memo (at most INLINE_TEXTS
    texts and INLINE_CHARS characters: a few queries, or one 512-token passage)."""
    return len(texts) <= INLINE_TEXTS and sum(len(t) for t in texts) <= INLINE_CHARS


class TokenizerCore:
    """One model's tokenizer without threads or processes: texts in, token id lists out.

    `memo_chunks` bounds the chunk memo that query-sized requests are tokenized from (0: none).
    `rust_threads` is the size of Rust's thread pool (RAYON_NUM_THREADS where that is set; None:
    one a core), which the ASCII twin sizes its joined inputs to.
    """

    def __init__(self, tokenizer_path: str | Path, max_tokens: int, *, eos_id: int | None = None,
                 memo_chunks: int = MEMO_CHUNKS, rust_threads: int | None = None) -> None:
        self.max_tokens = int(max_tokens)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        self.full = load(tokenizer_path)
        self.eos_id = eos_id
        # Tokens the tokenizer itself may produce: one fewer when EOS is appended here.
        self.room = self.max_tokens - (1 if self.eos_id is not None else 0)
        specials = len(self.full.encode("", add_special_tokens=True).ids)
        if self.room <= specials:  # no room for a single token of text: truncation could not hold the limit
            raise ValueError(f"max_tokens {max_tokens} leaves no room for text beside the "
                             f"{specials + self.max_tokens - self.room} special tokens")
        self.truncating = load(tokenizer_path, truncate_at=self.room)
        self.rust_threads = int(rust_threads or os.cpu_count() or 1)
        # Twins for ASCII texts (None: this tokenizer has no such twin).
        self.full_twin = AsciiTwin.of(self.full, self.rust_threads)
        self.truncating_twin = AsciiTwin.of(self.truncating, self.rust_threads)
        # One chunk memo serves both twins, whose plain ids are the same (0 chunks: no memo).
        self.memo = (ChunkMemo.of(self.full_twin, memo_chunks)
                     if self.full_twin is not None and memo_chunks > 0 else None)
        self.special_ids = frozenset(i for i, tok in self.full.get_added_tokens_decoder().items()
                                     if tok.special)
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        self.windows = Windows.of(self.full)

    def ids_of(self, texts: list[str], how: str) -> list[list[int]]:
        """The model's ids: "truncate" and "full" with special tokens and EOS where the model
        needs it (cut to the limit, or not cut), "plain" without special tokens and not cut (at
        most SPARSE_MAX_TOKENS for a text over LONG_TEXT_CHARS). A "full" text over the limit
        may come back as only its first tokens past the limit (enough to refuse it)."""
        if self.windows is not None and texts and max(map(len, texts)) > LONG_TEXT_CHARS:
            seqs = self._ids_of_short([t if len(t) <= LONG_TEXT_CHARS else "" for t in texts], how)
            for i, text in enumerate(texts):
                if len(text) > LONG_TEXT_CHARS:
                    seqs[i] = self._long_ids(text, how)
        else:
            seqs = self._ids_of_short(texts, how)
        # Appended where the ids are made (a worker process, a thread), so that the ids a worker
        # sends back as an array are the model's whole input.
        if how != "plain" and self.eos_id is not None:
            for ids in seqs:
                ids.append(self.eos_id)
        return seqs

    def checked(self, seqs: list[Sequence[int]], how: str, field: str, offset: int,
                texts: Sequence[str]) -> list[Sequence[int]]:
        """`ids_of`'s ids (lists, or a worker process's int32 arrays); "full" ones over the limit
        are refused, naming the first such input (a long text's count is of what was read)."""
        if how == "full":
            for i, ids in enumerate(seqs):
                if len(ids) > self.max_tokens:
                    partial = "+" if self.windows is not None and len(texts[i]) > LONG_TEXT_CHARS else ""
                    raise invalid_argument(
                        f"{field}[{offset + i}]: {len(ids)}{partial} tokens exceeds the model's limit of "
                        f"{self.max_tokens} tokens (truncation is TRUNCATION_ERROR)", offset + i)
        return seqs

    def _ids_of_short(self, texts: list[str], how: str) -> list[list[int]]:
        if how == "truncate":
            return self._batch(self.truncating, self.truncating_twin, texts, True)
        return self._batch(self.full, self.full_twin, texts, how != "plain")

    def _long_ids(self, text: str, how: str) -> list[int]:
        """`ids_of` for one long text, tokenized a window at a time and only as far as needed.

        The windows are cut where no token spans the cut (`Windows`), so the whole text's plain
        ids are its windows' plain ids, in order. Truncation keeps the first tokens: once the
        windows read hold the room, those windows alone (the head) give the whole text's
        truncated ids. A text whose windows never fill the room has all its ids known.
        """
        windows = self.windows
        room = self.room - windows.specials
        need = {"truncate": room, "full": room + 1, "plain": SPARSE_MAX_TOKENS}[how]
        body: list[int] = []
        start = 0
        while start < len(text) and len(body) < need:
            end = windows.cut(text, start + LONG_WINDOW_CHARS)
            body += self._batch(self.full, self.full_twin, [text[start:end]], False)[0]
            start = end
        if how == "plain":
            return body[:SPARSE_MAX_TOKENS]
        if how == "truncate" and len(body) >= room:
            return self._batch(self.truncating, self.truncating_twin, [text[:start]], True)[0]
        return [*windows.prefix, *body, *windows.suffix]

    def _batch(self, tokenizer: Tokenizer, twin: AsciiTwin | None, texts: list[str],
               special: bool) -> list[list[int]]:
        if twin is None or not texts:
            return encode_ids(tokenizer, texts, special)
        small = query_sized(texts)
        if twin.fits("\n".join(texts)):  # one pass over the batch: the common case
            return self._twin_ids(twin, texts, special, small)
        fast = [twin.fits(t) for t in texts]
        if not any(fast):
            return encode_ids(tokenizer, texts, special)
        easy = iter(self._twin_ids(twin, [t for t, f in zip(texts, fast) if f], special, small))
        hard = iter(encode_ids(tokenizer, [t for t, f in zip(texts, fast) if not f], special))
        return [next(easy) if f else next(hard) for f in fast]

    def _twin_ids(self, twin: AsciiTwin, texts: list[str], special: bool, small: bool) -> list[list[int]]:
        # A query-sized request's from the chunk memo, in Python under the GIL (on the loop,
        # which holds it anyway); a bulk one's from Rust's threads, which run without it.
        # __init__ refuses a limit with no room beside the special tokens, as the memo needs.
        if small and self.memo is not None:
            return self.memo.encode(texts, special, twin.limit)
        return twin.encode(texts, special)
