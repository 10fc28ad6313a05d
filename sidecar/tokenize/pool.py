"""Worker processes that tokenize bulk requests, each with its own GIL, shared by a sidecar's models.

Reading ids off Encodings holds the GIL, and in one process that GIL is also the engine loop's;
on a host with cores to spare a bulk request's slices are tokenized in worker processes instead.
A worker sends its ids back as int32 bytes. The model's ids stay int32 arrays here, views into
those bytes that the engine packs with one copy, so no Python int is made for them under the
GIL; sparse-vector ids ("plain") become lists, which their consumers count as ints. The processes
are spawned (the parent holds CUDA and threads), so they start from a clean interpreter.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np

from sidecar.tokenize.core import TokenizerCore

log = logging.getLogger(__name__)

# A bulk request (at least this many characters: ~4,000 English tokens, a few ms of one core's
# tokenizing) goes to the worker processes when there are any; smaller ones would pay more for
# the round trip through a process's queues than they save.
PROCESS_CHARS = 16384
# A request on the worker processes is cut into slices of about this many characters (and at
# most a tokenizer's slice_texts texts), so that a few requests in flight keep every process busy.
PROCESS_SLICE_CHARS = 65536


def default_processes(cpus: int | None = None) -> int:
    """Tokenizer worker processes for bulk requests: one per 4 cores from 8 cores up, none below.

    More, smaller workers crowd the cores that the engine's thread and the loop need; on a few
    cores there is no core to give them, and the threads tokenize faster.
    """
    cpus = cpus or os.cpu_count() or 1
    return cpus // 4 if cpus >= 8 else 0


def default_process_threads(processes: int, cpus: int | None = None) -> int:
    """Rust threads per worker process: the cores less two (the loop and the engine), shared out."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, (cpus - 2) // max(1, processes))


class WorkerModel(NamedTuple):
    """What a worker process needs to build a model's tokenizer (and the key it keeps it by)."""

    tokenizer_path: str
    max_tokens: int
    eos_id: int | None


class _WorkerTokenizers:
    """In a worker process: the size of its Rust pool and a TokenizerCore per model it serves."""

    def __init__(self) -> None:
        self.rust_threads = 1
        self.cores: dict[WorkerModel, TokenizerCore] = {}

    def start(self, rust_threads: int, models: tuple[WorkerModel, ...]) -> None:
        # Rust's thread pool starts at its first parallel call and reads RAYON_NUM_THREADS then.
        # The models known when the pool starts are loaded now; one added later by its first slice.
        os.environ["RAYON_NUM_THREADS"] = str(rust_threads)
        self.rust_threads = rust_threads
        for model in models:
            self.core(model)

    def core(self, model: WorkerModel) -> TokenizerCore:
        core = self.cores.get(model)
        if core is None:
            core = self.cores[model] = TokenizerCore(model.tokenizer_path, model.max_tokens, eos_id=model.eos_id,
                                                     memo_chunks=0, rust_threads=self.rust_threads)
        return core


# The one set of tokenizers of this process, filled only where it runs as a worker.
_WORKER = _WorkerTokenizers()


def _start_worker(rust_threads: int, models: tuple[WorkerModel, ...]) -> None:
    _WORKER.start(rust_threads, models)


def _worker_ids(model: WorkerModel, texts: list[str], how: str) -> tuple[bytes, bytes]:
    """`TokenizerCore.ids_of` in a worker process, packed: every id as int32, then each text's count."""
    seqs = _WORKER.core(model).ids_of(texts, how)
    flat = array("i")
    for ids in seqs:
        flat.extend(ids)
    return flat.tobytes(), array("i", map(len, seqs)).tobytes()


def _unpacked(packed: tuple[bytes, bytes], how: str) -> list[np.ndarray] | list[list[int]]:
    """The ids `_worker_ids` packed: read-only int32 views into its bytes, lists for "plain"."""
    flat = np.frombuffer(packed[0], dtype=np.int32)
    ends = np.cumsum(np.frombuffer(packed[1], dtype=np.int32)).tolist()
    if how == "plain":
        ids = flat.tolist()
        return [ids[start:end] for start, end in zip([0, *ends], ends)]
    return [flat[start:end] for start, end in zip([0, *ends], ends)]


class TokenizerProcesses:
    """The worker processes that tokenize bulk requests, shared by the models of a sidecar.

    Each worker holds a tokenizer for every model that `add`ed itself: the models known when the
    pool starts are loaded by each worker as it starts, a later one by its first slice there. So
    a sidecar serving several models runs one set of `processes` workers (default_processes),
    not one per model, and a busy model has all of them. The processes are spawned (the parent
    holds CUDA and threads) when `start` is first called, in the background, so that the first
    bulk request does not wait for them. After a worker dies, a pool that had served is replaced;
    one that never served (workers that cannot start: a main module that starts Fern again when
    spawned) is given up, and every model tokenizes on its threads.
    """

    def __init__(self, processes: int, threads: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = int(processes)
        self.threads = threads or default_process_threads(self.processes)
        self._models: list[WorkerModel] = []
        self._users = 0
        self._pool: ProcessPoolExecutor | None = None
        self._served = False
        self.given_up = False

    def add(self, model: WorkerModel) -> None:
        """A model's tokenizer will send its slices here."""
        if model not in self._models:
            self._models.append(model)
        self._users += 1

    def start(self) -> None:
        """Start the workers now (a no-op once started or given up)."""
        if self._pool is None and not self.given_up:
            self._pool = self._started()

    def _started(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self.threads, tuple(self._models)))
        for _ in range(self.processes):
            pool.submit(len, "")
        self._served = False
        return pool

    @property
    def live(self) -> int:
        """Workers that take bulk requests now (0: given up)."""
        return 0 if self.given_up else self.processes

    async def ids(self, model: WorkerModel, texts: list[str],
                  how: str) -> tuple[list[np.ndarray] | list[list[int]] | None, str]:
        """`model`'s ids of `texts` from a worker (`_unpacked`), and "" when the slice was served; else no ids
        and what happened to the pool: "restarted" (a worker died; a new pool takes over), "died"
        (the same, seen by another slice first), "failed" (the pool never served and is given
        up) or "gone" (given up before)."""
        self.start()
        pool = self._pool
        if pool is None:
            return None, "gone"
        try:
            packed = await asyncio.get_running_loop().run_in_executor(pool, _worker_ids, model, texts, how)
        except BrokenProcessPool:
            if self._pool is not pool:  # another slice has dealt with this pool
                return None, "died"
            if self._served:
                log.warning("a tokenizer worker process died; starting new ones")
                self._pool = self._started()
                return None, "restarted"
            log.error("tokenizer worker processes failed before serving; tokenizing on threads "
                      "(FERN_TOKENIZER_PROCESSES=0 skips them)")
            self._pool, self.given_up = None, True
            return None, "failed"
        if self._pool is pool:
            self._served = True
        return _unpacked(packed, how), ""

    def remove(self) -> None:
        """A model's tokenizer is done with the processes; the last one stops them."""
        self._users -= 1
        if self._users <= 0 and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
