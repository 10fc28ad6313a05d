"""Batch tokenization for the gateway: Rust `tokenizers` on worker threads, off the event loop.

The model's tokenizer.json is loaded with its padding switched off (packed batches need
none) and its truncation set to the model's real limit (`spec.max_tokens`, e.g. 256 for
all-MiniLM-L6-v2, whose shipped tokenizer.json says 128). Special tokens ([CLS] ... [SEP],
<s> ... </s>) are added by the tokenizer's own post-processor and survive truncation.
Models whose pooling reads the last token (Qwen3-Embedding) need an end-of-text token
there; when the tokenizer.json does not append it (ModelSpec.append_eos), it is appended
here, truncating one token earlier to make room, as the model's reference code does.

`encode_batch_fast` (no character offsets) does the work; it releases the GIL and fans
out over Rust threads, and large requests are cut into slices spread over several
Python worker threads, so tokenizing a bulk request never holds up the asyncio loop
that feeds the GPU. Only a query-sized request (a few short texts) is tokenized on the
loop itself, where it costs less than the thread hop would.

BERT tokenizers (WordPiece behind a `BertNormalizer`: MiniLM, BGE, E5, GTE) normalize
every text with control-character cleanup, CJK spacing, NFD accent stripping and
lowercasing. On printable ASCII (0x20-0x7E) all but the lowercasing are the identity,
yet they cost a third of a query's tokenization (128 tokens: 164 -> 109 us measured on
the 2-core CI host). A batch of printable-ASCII texts therefore goes through a copy of
the tokenizer whose normalizer only lowercases: same ids, less work.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer, normalizers

from core_engine.config import ModelSpec
from sidecar.errors import invalid_argument

# Texts per worker slice: large enough to amortize a thread hop, small enough that a bulk
# request spreads over the workers and an online request never waits behind a whole one.
SLICE_TEXTS = 256


# A query this small tokenizes in tens of microseconds, less than the hop to a worker
# thread and back (~0.3 ms measured on a busy 2-core host): it is done on the loop.
INLINE_TEXTS = 4
INLINE_CHARS = 2048


def default_workers() -> int:
    """Tokenizer worker threads: a few, since each `encode_batch_fast` call fans out in Rust."""
    return max(2, min(8, os.cpu_count() or 2))


def _ascii_twin(tokenizer: Tokenizer) -> Tokenizer | None:
    """A copy of `tokenizer` that gives the same ids on printable-ASCII texts with less
    normalization, or None when its normalizer is not a lowercasing BertNormalizer."""
    config = json.loads(tokenizer.to_str()).get("normalizer") or {}
    if config.get("type") != "BertNormalizer" or not config.get("lowercase"):
        return None
    twin = Tokenizer.from_str(tokenizer.to_str())
    twin.normalizer = normalizers.Lowercase()
    return twin


class TextTokenizer:
    """One model's tokenizer: texts in, token id lists (special tokens included) out.

    `encode` is the synchronous core; `encode_async` runs it on the worker pool. Inputs
    over `max_tokens` are cut at the end when `truncate` is true and rejected with
    INVALID_ARGUMENT (naming the input and its token count) when it is false.
    """

    def __init__(self, tokenizer_path: str | Path, max_tokens: int, *, eos_id: int | None = None,
                 workers: int | None = None) -> None:
        self.max_tokens = int(max_tokens)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        self._full = Tokenizer.from_file(str(tokenizer_path))
        self._full.no_padding()
        self._full.no_truncation()
        self.eos_id = eos_id
        # Tokens the tokenizer itself may produce: one fewer when EOS is appended here.
        self._room = self.max_tokens - (1 if self.eos_id is not None else 0)
        self._truncating = Tokenizer.from_file(str(tokenizer_path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(self._room)
        # Lowercase-only twins for printable-ASCII batches (None: this tokenizer has no such twin).
        self._full_ascii = _ascii_twin(self._full)
        self._truncating_ascii = _ascii_twin(self._truncating)
        self.special_ids = frozenset(i for i, tok in self._full.get_added_tokens_decoder().items()
                                     if tok.special)
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self._pool = ThreadPoolExecutor(workers or default_workers(),
                                        thread_name_prefix="fern-tokenize")
        # tokenizers >= 0.21 can skip computing character offsets, which Fern never reads.
        self._fast = hasattr(self._full, "encode_batch_fast")

    def _batch(self, tokenizer: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
        ascii_twin = self._truncating_ascii if tokenizer is self._truncating else self._full_ascii
        if ascii_twin is not None and all(t.isascii() and t.isprintable() for t in texts):
            tokenizer = ascii_twin
        encode = tokenizer.encode_batch_fast if self._fast else tokenizer.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=special)]

    @classmethod
    def for_spec(cls, spec: ModelSpec, workers: int | None = None) -> "TextTokenizer":
        """The tokenizer of a core_engine ModelSpec (EOS appended when `spec.append_eos`)."""
        return cls(spec.tokenizer_path, spec.max_tokens,
                   eos_id=spec.eos_token_id if spec.append_eos else None, workers=workers)

    def encode(self, texts: Sequence[str], *, truncate: bool = True, field: str = "texts",
               offset: int = 0) -> list[list[int]]:
        """Token ids of each text; errors name `field[offset + i]`."""
        if truncate:
            seqs = self._batch(self._truncating, list(texts), True)
        else:
            seqs = self._batch(self._full, list(texts), True)
            for i, ids in enumerate(seqs):
                if len(ids) > self._room:
                    count = len(ids) + (1 if self.eos_id is not None else 0)
                    raise invalid_argument(
                        f"{field}[{offset + i}]: {count} tokens exceeds the model's limit of "
                        f"{self.max_tokens} tokens (truncation is TRUNCATION_ERROR)", offset + i)
        if self.eos_id is not None:
            for ids in seqs:
                ids.append(self.eos_id)
        return seqs

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids without special tokens and without truncation (for sparse vectors)."""
        return self._batch(self._full, list(texts), False)

    async def encode_async(self, texts: Sequence[str], *, truncate: bool = True,
                           field: str = "texts", offset: int = 0) -> list[list[int]]:
        """`encode` on the worker pool, in slices of SLICE_TEXTS run in parallel.

        When several slices fail, the error of the lowest input index is raised."""
        if self._small(texts):
            return self.encode(texts, truncate=truncate, field=field, offset=offset)
        return await self._run_slices(texts, lambda part, start: self.encode(
            part, truncate=truncate, field=field, offset=offset + start))

    async def encode_plain_async(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_plain` on the worker pool."""
        if self._small(texts):
            return self.encode_plain(texts)
        return await self._run_slices(texts, lambda part, start: self.encode_plain(part))

    @staticmethod
    def _small(texts: Sequence[str]) -> bool:
        return len(texts) <= INLINE_TEXTS and sum(len(t) for t in texts) <= INLINE_CHARS

    async def _run_slices(self, texts: Sequence[str], work) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, work, texts[s:s + SLICE_TEXTS], s)
                   for s in range(0, len(texts), SLICE_TEXTS)]
        seqs: list[list[int]] = []
        for part in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(part, BaseException):
                raise part
            seqs.extend(part)
        return seqs

    def truncate_ids(self, ids: Sequence[int]) -> list[int]:
        """Cut pre-tokenized ids to max_tokens at the end, keeping a trailing special token."""
        if len(ids) <= self.max_tokens:
            return list(ids)
        if ids[-1] in self.special_ids:
            return [*ids[:self.max_tokens - 1], ids[-1]]
        return list(ids[:self.max_tokens])

    def close(self) -> None:
        """Stop the worker threads (pending slices finish first)."""
        self._pool.shutdown(wait=True)
