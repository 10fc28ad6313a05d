"""The chunk memo: a query's ids from its whitespace-separated chunks' known ids, without a Rust call.

Rust's fixed cost per call (the Encoding, the regex pre-tokenizer) is most of a short text's.
The ASCII twin's words never cross a blank and WordPiece goes a word at a time, so a text's ids
are its blank-separated chunks' ids in order: dictionary lookups, in a bounded memo that misses
fill. Special tokens and truncation are then applied as the post-processor applies them.
"""

from __future__ import annotations

from itertools import chain, compress, count
from operator import gt

from tokenizers import Tokenizer

from sidecar.tokenize.ascii import AsciiTwin
from sidecar.tokenize.rust import encode_ids, fixed_specials
from sidecar.tokenize.wordpiece import WordPiece

# Chunks ("world," "(really?)") the memo holds. An entry takes ~350 bytes on words (10 MiB
# full), ~1.4 KB at worst (32 punctuation marks: 45 MiB full); a full memo is emptied and
# refills from later misses. 0 turns it off, for a stream of mostly unseen words, IDs or hashes.
MEMO_CHUNKS = 1 << 15
# Longer chunks (URLs, hashes, [UNK]-sized words) are rare in a query and are not kept.
MEMO_CHUNK_CHARS = 32
# A text whose chunks are mostly new gets its ids from one Rust call as without the memo, and
# a second call on at most this many of its new chunks fills the memo: a text of unseen chunks
# costs less than two Rust calls, and the memo still warms up.
MEMO_LEARN_CHUNKS = 16


class ChunkMemo:
    """The twin's ids for a few texts, from a memo of their whitespace-separated chunks' ids.

    A text's plain ids are its chunks' plain ids in order; special tokens and truncation are
    then applied as the post-processor does: prefix + body cut to the limit less the special
    tokens + suffix. Up to MEMO_LEARN_CHUNKS chunks missing from the memo go through `WordPiece`
    when the model is WordPiece; more are tokenized by the twin itself in one call, joined by
    spaces (no added token holds whitespace, so none can match across two chunks) and told
    apart by their tokens' offsets. A text made mostly of new chunks is tokenized whole
    instead, and teaches the memo MEMO_LEARN_CHUNKS of them. `entries` bounds the memo: one
    that would grow past it is emptied first.
    """

    def __init__(self, tokenizer: Tokenizer, prefix: list[int], suffix: list[int],
                 entries: int = MEMO_CHUNKS, chars: int = MEMO_CHUNK_CHARS) -> None:
        self._tokenizer = tokenizer
        self._wordpiece = WordPiece.of(tokenizer)
        self._prefix, self._suffix = prefix, suffix
        self.specials = len(prefix) + len(suffix)
        self._entries, self._chars = entries, chars
        self._memo: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def of(twin: AsciiTwin, entries: int = MEMO_CHUNKS, chars: int = MEMO_CHUNK_CHARS) -> "ChunkMemo | None":
        """The memo for `twin`, or None when it pads, an added token holds whitespace or the
        post-processor does more than put fixed tokens around the text's ids."""
        tokenizer = twin.untruncated
        if tokenizer.padding is not None:
            return None
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        if any(ch.isspace() for content in added for ch in content):
            return None
        around = fixed_specials(tokenizer)
        if around is None:
            return None
        prefix, suffix, plain = around
        if set(plain) & set(prefix + suffix):
            return None
        return ChunkMemo(tokenizer, prefix, suffix, entries, chars)

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        """Forget every chunk."""
        self._memo.clear()

    def encode(self, texts: list[str], special: bool, limit: int | None) -> list[list[int]]:
        """Ids of texts that the twin `fits`, as its `encode` gives them truncated to `limit`
        (which must leave room for the special tokens)."""
        seqs = []
        for text in texts:
            lowered = text.lower()
            chunks = lowered.split()  # under `fits`, str.split's whitespace is the twin's
            try:
                body = list(chain.from_iterable(map(self._memo.__getitem__, chunks)))
            except KeyError:
                body = self._miss(lowered, chunks)
            room = None if limit is None else limit - (self.specials if special else 0)
            if room is not None and len(body) > room:
                del body[room:]
            if special:
                body = [*self._prefix, *body, *self._suffix]
            seqs.append(body)
        return seqs

    def _miss(self, lowered: str, chunks: list[str]) -> list[int]:
        """The plain ids of `lowered` (split into `chunks`), some of which the memo lacks."""
        memo = self._memo
        known = {chunk: memo.get(chunk) for chunk in chunks}
        missing = [chunk for chunk, ids in known.items() if ids is None]
        if len(missing) <= MEMO_LEARN_CHUNKS or 2 * len(missing) <= len(known):  # only they are tokenized
            learned = self._few(missing) if len(missing) <= MEMO_LEARN_CHUNKS else self._tokenize(missing)
            known.update(learned)
            body = list(chain.from_iterable(map(known.__getitem__, chunks)))
        else:  # mostly new: the text in one call as without the memo, which learns some of them
            body = encode_ids(self._tokenizer, [lowered], False)[0]
            learned = self._few([c for c in missing if len(c) <= self._chars][:MEMO_LEARN_CHUNKS])
        kept = [(chunk, ids) for chunk, ids in learned.items() if len(chunk) <= self._chars][:self._entries]
        if len(memo) + len(kept) > self._entries:
            memo.clear()
        memo.update(kept)
        return body

    def _few(self, chunks: list[str]) -> dict[str, tuple[int, ...]]:
        """`_tokenize` for at most MEMO_LEARN_CHUNKS chunks: through `WordPiece` where there is
        one, which costs less than the Rust call at such counts. A text of mostly new chunks is
        still tokenized whole by Rust (`_miss`)."""
        if self._wordpiece is None:
            return self._tokenize(chunks)
        return {chunk: self._wordpiece.ids(chunk) for chunk in chunks}

    def _tokenize(self, chunks: list[str]) -> dict[str, tuple[int, ...]]:
        """The twin's plain ids of each of `chunks`, from one call on them joined by spaces."""
        if not chunks:
            return {}
        encoding = self._tokenizer.encode(" ".join(chunks), add_special_tokens=False)
        starts, ends = zip(*encoding.offsets)
        # A chunk's tokens are contiguous (its words are, and so are a word's pieces) and a
        # space separates two chunks: a chunk's first token is the one after a gap.
        firsts = [0, *compress(count(1), map(gt, starts[1:], ends)), len(starts)]
        if len(firsts) != len(chunks) + 1:
            raise RuntimeError(f"{len(firsts) - 1} token runs for {len(chunks)} chunks: {chunks[:8]!r}")
        ids = tuple(encoding.ids)
        return dict(zip(chunks, [ids[a:b] for a, b in zip(firsts, firsts[1:])]))
