"""The gateway's tokenizer: one model's TokenizerCore, run off the event loop on threads or worker processes.

`encode_batch_fast` releases the GIL and fans out over Rust threads, and large requests are cut
into slices spread over several Python worker threads, so tokenizing a bulk request never holds
up the asyncio loop that feeds the GPU. Only a query-sized request (`query_sized`) is tokenized
on the loop itself, where it costs less than the thread hop would. Where there are worker
processes (TokenizerProcesses), a bulk request's slices go to them, and their ids come back as
int32 arrays rather than lists; a slice whose worker dies is redone on the threads.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core_engine.config import ModelSpec
from sidecar.tokenize.core import TokenizerCore, query_sized
from sidecar.tokenize.memo import MEMO_CHUNKS
from sidecar.tokenize.pool import (PROCESS_CHARS, PROCESS_SLICE_CHARS, TokenizerProcesses, WorkerModel,
                                   default_processes)

# Texts per worker slice: large enough to amortize a thread hop, small enough that a bulk
# request spreads over the workers and an online request never waits behind a whole one.
SLICE_TEXTS = 256


def default_workers() -> int:
    """Tokenizer worker threads: a few, since each `encode_batch_fast` call fans out in Rust."""
    return max(2, min(8, os.cpu_count() or 2))


class TextTokenizer:
    """One model's tokenizer: texts in, token ids (special tokens included) out.

    `encode` is the synchronous core; `encode_async` runs it on the worker pool. Inputs
    over `max_tokens` are cut at the end when `truncate` is true and rejected with
    INVALID_ARGUMENT (naming the input and its token count) when it is false.
    `memo_chunks` bounds the chunk memo that query-sized requests are tokenized from (0: none).
    `rust_threads` is the size of Rust's thread pool in this process (None: one a core).
    """

    def __init__(self, tokenizer_path: str | Path, max_tokens: int, *, eos_id: int | None = None,
                 workers: int | None = None, slice_texts: int = SLICE_TEXTS,
                 memo_chunks: int = MEMO_CHUNKS, processes: int | TokenizerProcesses | None = None,
                 process_threads: int | None = None, process_slice_chars: int = PROCESS_SLICE_CHARS,
                 rust_threads: int | None = None) -> None:
        self.core = TokenizerCore(tokenizer_path, max_tokens, eos_id=eos_id, memo_chunks=memo_chunks,
                                  rust_threads=rust_threads)
        self.max_tokens = self.core.max_tokens
        self.eos_id = eos_id
        self.special_ids = self.core.special_ids
        self.vocab_size = self.core.vocab_size
        self.slice_texts = int(slice_texts)
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers,
                                        thread_name_prefix="fern-tokenize")
        # Worker processes for bulk requests: a sidecar's shared ones (its registry starts them
        # once every model is added), or this tokenizer's own (`processes` of them,
        # default_processes when None; 0: none), started here, after this model is added, so
        # that each worker loads its tokenizer as it starts rather than on its first slice.
        own = not isinstance(processes, TokenizerProcesses)
        if own:
            count = default_processes() if processes is None else int(processes)
            processes = TokenizerProcesses(count, process_threads) if count > 0 else None
        self._processes = processes
        self._model = WorkerModel(str(tokenizer_path), self.max_tokens, eos_id)
        if processes is not None:
            processes.add(self._model)
            if own:
                processes.start()
        # Counters for /metrics: slices the worker processes tokenized, slices redone on the
        # threads because their worker died, and pools started anew after such a death.
        self.process_slices = self.process_failures = self.process_restarts = 0
        self.process_slice_chars = int(process_slice_chars)

    @classmethod
    def for_spec(cls, spec: ModelSpec, workers: int | None = None,
                 processes: int | TokenizerProcesses | None = None, *,
                 memo_chunks: int = MEMO_CHUNKS, rust_threads: int | None = None) -> "TextTokenizer":
        """The tokenizer of a core_engine ModelSpec (EOS appended when `spec.append_eos`)."""
        return cls(spec.tokenizer_path, spec.max_tokens,
                   eos_id=spec.eos_token_id if spec.append_eos else None, workers=workers,
                   processes=processes, memo_chunks=memo_chunks, rust_threads=rust_threads)

    def encode(self, texts: Sequence[str], *, truncate: bool = True, field: str = "texts",
               offset: int = 0) -> list[list[int]]:
        """Token id lists of each text; errors name `field[offset + i]`."""
        how = "truncate" if truncate else "full"
        texts = list(texts)
        return self.core.checked(self.core.ids_of(texts, how), how, field, offset, texts)

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids without special tokens and without truncation (for sparse vectors)."""
        return self.core.ids_of(list(texts), "plain")

    async def encode_async(self, texts: Sequence[str], *, truncate: bool = True,
                           field: str = "texts", offset: int = 0) -> list[Sequence[int]]:
        """`encode` off the loop, in slices of `slice_texts` run in parallel: on the worker
        processes for a bulk request where there are any (those slices' ids are int32 arrays),
        else on the worker threads.

        When several slices fail, the error of the lowest input index is raised."""
        if query_sized(texts):
            return self.encode(texts, truncate=truncate, field=field, offset=offset)
        return await self._run_slices(texts, "truncate" if truncate else "full", field, offset)

    async def encode_plain_async(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_plain` off the loop, as `encode_async` runs it."""
        if query_sized(texts):
            return self.encode_plain(texts)
        return await self._run_slices(texts, "plain", "texts", 0)

    @property
    def processes(self) -> int:
        """The worker processes this tokenizer's bulk requests go to (shared with other models)."""
        return self._processes.processes if self._processes is not None else 0

    @property
    def live_processes(self) -> int:
        """Worker processes that take bulk requests now (0: none configured, or given up)."""
        return self._processes.live if self._processes is not None else 0

    async def _run_slices(self, texts: Sequence[str], how: str, field: str, offset: int) -> list[Sequence[int]]:
        procs = self._processes if self.live_processes and sum(map(len, texts)) >= PROCESS_CHARS else None
        starts = self._process_cuts(texts) if procs is not None else range(0, len(texts), self.slice_texts)
        ends = [*starts[1:], len(texts)]
        slices = [list(texts[a:b]) for a, b in zip(starts, ends)]
        parts = await asyncio.gather(*(self._slice(procs, part, how) for part in slices), return_exceptions=True)
        seqs: list[Sequence[int]] = []
        for start, part in zip(starts, parts):
            if isinstance(part, BaseException):
                raise part
            seqs.extend(self.core.checked(part, how, field, offset + start, texts[start:start + len(part)]))
        return seqs

    def _process_cuts(self, texts: Sequence[str]) -> list[int]:
        """Where the worker processes' slices of `texts` start: every process_slice_chars
        characters or slice_texts texts, whichever comes first."""
        cuts, chars = [0], 0
        for i, text in enumerate(texts, 1):
            chars += len(text)
            if (chars >= self.process_slice_chars or i - cuts[-1] >= self.slice_texts) and i < len(texts):
                cuts.append(i)
                chars = 0
        return cuts

    async def _slice(self, procs: TokenizerProcesses | None, texts: list[str], how: str) -> list[Sequence[int]]:
        if procs is not None:
            seqs, fate = await procs.ids(self._model, texts, how)
            if seqs is not None:
                self.process_slices += 1
                return seqs
            # A worker died, or the pool had been given up: this slice is redone on the threads,
            # so no accepted text is lost.
            self.process_failures += fate != "gone"
            self.process_restarts += fate == "restarted"
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.core.ids_of, texts, how)

    def truncate_ids(self, ids: Sequence[int]) -> list[int]:
        """Cut pre-tokenized ids to max_tokens at the end, keeping a trailing special token."""
        if len(ids) <= self.max_tokens:
            return list(ids)
        if ids[-1] in self.special_ids:
            return [*ids[:self.max_tokens - 1], ids[-1]]
        return list(ids[:self.max_tokens])

    def close(self) -> None:
        """Stop the worker threads and processes (pending slices finish first)."""
        self._pool.shutdown(wait=True)
        if self._processes is not None:
            self._processes.remove()
            self._processes = None
