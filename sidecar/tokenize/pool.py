"""Worker processes that tokenize bulk requests, each with its own GIL, shared by a sidecar's models.

Reading ids off Encodings holds the GIL, and in one process that GIL is also the engine loop's;
on a host with cores to spare a bulk request's slices are tokenized in worker processes instead.
A worker sends its ids back as int32 bytes. The model's ids stay int32 arrays here, views into
those bytes that the engine packs with one copy, so no Python int is made for them under the
GIL; sparse-vector ids ("plain") become lists, which their consumers count as ints. The processes
are spawned (the parent holds CUDA and threads), so they start from a clean interpreter.

Each worker has a pipe each way, and the event loop that sends a slice writes it and reads the
answer itself, non-blocking, as the pipes take and give bytes. A ProcessPoolExecutor would run
two threads in the sidecar for this (its manager and its queue's feeder), each taking the GIL for
every slice; the pipes take 27-40 % off the sidecar's CPU per token on the workers' path
(`python -m tools.profiling.tokenize_bench --processes 1`, `cpu_ms_per_m_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.context
import os
import pickle
from array import array
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable, NamedTuple

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
# A worker that has not answered a slice (~PROCESS_SLICE_CHARS of text: milliseconds of work) in this
# many seconds is taken to hang (stopped, deadlocked, starved), killed and replaced; the slice is
# redone on the threads. Without it a hung worker would hold its slice's request, and then every
# bulk request waiting for a free worker, forever.
HANG_S = 30.0


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

# Every message between the sidecar and a worker is its length (8 bytes, little-endian) and then
# its bytes. To a worker: a pickled (model, how, texts). From it: OK and then the packed ids
# (the flat ids' byte length in 8 bytes, the flat int32 ids, each text's int32 count), or FAILED
# and a pickled exception.
_LENGTH = 8
OK, FAILED = b"\x00", b"\x01"
# The most bytes one read of a worker's answer asks for.
_READ = 1 << 20


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_LENGTH, "little") + payload


def _read_exactly(fd: int, count: int) -> bytes | None:
    """`count` bytes from a blocking pipe, or None at its end."""
    buf, got = bytearray(count), 0
    view = memoryview(buf)
    while got < count:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _packed_ids(model: WorkerModel, texts: list[str], how: str) -> bytes:
    """`TokenizerCore.ids_of` packed: the flat ids' byte length, every id as int32, each text's count."""
    seqs = _WORKER.core(model).ids_of(texts, how)
    flat = array("i")
    for ids in seqs:
        flat.extend(ids)
    flat_bytes = flat.tobytes()
    return b"".join((OK, len(flat_bytes).to_bytes(_LENGTH, "little"), flat_bytes,
                     array("i", map(len, seqs)).tobytes()))


def _serve(requests: Connection, answers: Connection, rust_threads: int,
           models: tuple[WorkerModel, ...]) -> None:
    """A worker process: load the models, then answer each slice until the sidecar closes its pipe."""
    _WORKER.start(rust_threads, models)
    into, out = requests.fileno(), answers.fileno()
    while True:
        header = _read_exactly(into, _LENGTH)
        if header is None:
            return  # the sidecar is done with this worker
        message = _read_exactly(into, int.from_bytes(header, "little"))
        if message is None:
            return
        model, how, texts = pickle.loads(message)
        try:
            answer = _packed_ids(model, texts, how)
        except Exception as error:  # the sidecar raises it for this slice; the worker goes on
            error.add_note(f"in a tokenizer worker process, with the tokenizer {model.tokenizer_path}")
            try:
                answer = FAILED + pickle.dumps(error)
            except Exception:
                answer = FAILED + pickle.dumps(RuntimeError(f"tokenizer worker: {error!r}"))
        try:
            _write_all(out, _frame(answer))
        except BrokenPipeError:
            return  # the sidecar stopped this worker mid-slice


def _unpacked(answer: memoryview, how: str) -> list[np.ndarray] | list[list[int]]:
    """The ids `_packed_ids` packed (less its OK byte): read-only int32 views into the answer's
    bytes, lists for "plain"."""
    size = int.from_bytes(answer[:_LENGTH], "little")
    flat = np.frombuffer(answer, dtype=np.int32, count=size // 4, offset=_LENGTH)
    ends = np.cumsum(np.frombuffer(answer, dtype=np.int32, offset=_LENGTH + size)).tolist()
    if how == "plain":
        ids = flat.tolist()
        return [ids[start:end] for start, end in zip([0, *ends], ends)]
    return [flat[start:end] for start, end in zip([0, *ends], ends)]


class WorkerDied(Exception):
    """The worker process ended (or its pipe broke) before it answered."""


class _Worker:
    """One worker process, its two pipes, and the one slice it is serving.

    The sidecar's side of the pipes is non-blocking and driven by the event loop that sent the
    slice: its message is written as the pipe takes it and its answer read as it comes, so no
    thread of the sidecar's takes part and nothing blocks the loop. `settled` is called with
    the worker when a slice whose caller went away (cancelled) is over, answered or not.
    """

    def __init__(self, context: multiprocessing.context.SpawnContext, rust_threads: int,
                 models: tuple[WorkerModel, ...], settled: Callable[["_Worker"], None]) -> None:
        requests, self._requests = context.Pipe(duplex=False)
        self._answers, answers = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(requests, answers, rust_threads, models),
                                       name="fern-tokenizer", daemon=True)
        self.process.start()
        requests.close()  # the worker's ends: its exit closes them, which is how its death shows
        answers.close()
        self._out, self._in = self._requests.fileno(), self._answers.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._settled = settled
        self.busy = self.dead = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answer: asyncio.Future[memoryview] | None = None
        self._pending = memoryview(b"")
        self._header = bytearray()
        self._body: bytearray | None = None
        self._got = 0
        self._watchdog: asyncio.TimerHandle | None = None
        self.hung = False

    async def run(self, model: WorkerModel, texts: list[str], how: str, hang_s: float) -> memoryview:
        """The worker's answer to one slice (its bytes after the OK byte, read-only); raises
        WorkerDied, or what the worker raised. A cancelled call leaves the answer to be read
        and dropped. A worker that has not answered within `hang_s` is killed (WorkerDied)."""
        loop = asyncio.get_running_loop()
        self.busy, self._loop = True, loop
        self._answer = answer = loop.create_future()
        self._header, self._body, self._got = bytearray(), None, 0
        self._pending = memoryview(_frame(pickle.dumps((model, how, texts), protocol=pickle.HIGHEST_PROTOCOL)))
        self._watchdog = loop.call_later(hang_s, self._hang, hang_s)
        loop.add_reader(self._in, self._readable)
        self._writable()
        message = await answer
        if message[:1] == FAILED:
            raise pickle.loads(message[1:])
        return message[1:]

    def _writable(self) -> None:
        try:
            while self._pending:
                self._pending = self._pending[os.write(self._out, self._pending):]
        except BlockingIOError:
            self._loop.add_writer(self._out, self._writable)
            return
        except OSError:  # the worker's end is closed: it has died
            self._finish(None)
            return
        self._loop.remove_writer(self._out)

    def _readable(self) -> None:
        try:
            while True:
                if self._body is None:
                    chunk = os.read(self._in, _LENGTH - len(self._header))
                    if not chunk:
                        return self._finish(None)
                    self._header += chunk
                    if len(self._header) == _LENGTH:
                        self._body = bytearray(int.from_bytes(self._header, "little"))
                elif self._got == len(self._body):
                    return self._finish(memoryview(self._body).toreadonly())
                else:
                    n = os.readv(self._in, [memoryview(self._body)[self._got:self._got + _READ]])
                    if n == 0:
                        return self._finish(None)
                    self._got += n
        except BlockingIOError:
            return
        except OSError:
            return self._finish(None)

    def _hang(self, hang_s: float) -> None:
        """The slice is overdue: kill the worker; its pipe's end then fails the slice (WorkerDied)."""
        log.warning("tokenizer worker process %d did not answer a slice within %g s; killing it",
                    self.process.pid, hang_s)
        self.hung = True
        self.process.kill()

    def _finish(self, message: memoryview | None) -> None:
        """The slice is over: answered (`message`), or not because the worker is gone."""
        loop, answer = self._loop, self._answer
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._in)
            loop.remove_writer(self._out)
        self._answer, self._pending = None, memoryview(b"")
        self.busy, self.dead = False, self.dead or message is None
        if answer is None or loop.is_closed():
            return
        if answer.done():  # its caller went away
            self._settled(self)
        elif message is None:
            answer.set_exception(WorkerDied())
        else:
            answer.set_result(message)

    def stranded(self) -> bool:
        """Busy with a slice whose loop has closed: no one will read its answer."""
        return self.busy and self._loop is not None and self._loop.is_closed()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail the slice it serves (WorkerDied), close the pipes (the worker ends) and wait for it."""
        if self.busy:
            self._finish(None)
        self.dead = True
        self._requests.close()
        self._answers.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class TokenizerProcesses:
    """The worker processes that tokenize bulk requests, shared by the models of a sidecar.

    Each worker holds a tokenizer for every model that `add`ed itself: the models known when the
    pool starts are loaded by each worker as it starts, a later one by its first slice there. So
    a sidecar serving several models runs one set of `processes` workers (default_processes),
    not one per model, and a busy model has all of them. The processes are spawned (the parent
    holds CUDA and threads) when `start` is first called, in the background, so that the first
    bulk request does not wait for them. A worker serves one slice at a time; the event loop
    that sent it writes it to the worker's pipe and reads the answer (see _Worker), so the
    sidecar runs no thread for them and pickles nothing but the slice's texts. A worker that
    dies, or hangs on a slice for `hang_s` seconds (then it is killed), after the workers have
    served is replaced; if they never served (workers that cannot start: a main module that
    starts Fern again when spawned) they are given up, and every model tokenizes on its
    threads. Used from one thread (its event loop) at a time.
    """

    def __init__(self, processes: int, threads: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = int(processes)
        self.threads = threads or default_process_threads(self.processes)
        self._models: list[WorkerModel] = []
        self._users = 0
        self._workers: list[_Worker] = []
        self._idle: deque[_Worker] = deque()
        self._waiting: deque[asyncio.Future[_Worker]] = deque()
        self._started_with: tuple[WorkerModel, ...] = ()
        self._served = False
        self.given_up = False
        self.hang_s = HANG_S

    def add(self, model: WorkerModel) -> None:
        """A model's tokenizer will send its slices here."""
        if model not in self._models:
            self._models.append(model)
        self._users += 1

    def start(self) -> None:
        """Start the workers now (a no-op once started or given up)."""
        if not self._workers and not self.given_up:
            self._started_with, self._served = tuple(self._models), False
            self._workers = [self._spawn() for _ in range(self.processes)]
            self._idle = deque(self._workers)

    def _spawn(self) -> _Worker:
        return _Worker(multiprocessing.get_context("spawn"), self.threads, tuple(self._models), self._settled)

    @property
    def live(self) -> int:
        """Workers that take bulk requests now (0: given up)."""
        return 0 if self.given_up else self.processes

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return [w.process.pid for w in self._workers]

    async def ids(self, model: WorkerModel, texts: list[str],
                  how: str) -> tuple[list[np.ndarray] | list[list[int]] | None, str]:
        """`model`'s ids of `texts` from a worker (`_unpacked`), and "" when the slice was served; else no ids
        and what happened: "restarted" (its worker died; a new one takes its place), "failed"
        (the workers never served and are given up) or "gone" (given up, or the workers were
        stopped)."""
        self.start()
        worker = await self._free_worker()
        if worker is None:
            return None, "gone"
        try:
            answer = await worker.run(model, texts, how, self.hang_s)
        except WorkerDied:
            return None, self._died(worker)
        except asyncio.CancelledError:
            if not worker.busy:  # over before the cancel reached this call
                self._settled(worker)
            raise  # else _settled runs when the worker's answer comes
        except BaseException:
            self._release(worker)  # what the worker raised for this slice; it goes on
            raise
        self._served = True
        self._release(worker)
        return _unpacked(answer, how), ""

    async def _free_worker(self) -> _Worker | None:
        for worker in [w for w in self._workers if w.stranded()]:
            self._replace(worker)  # a loop that ended left it mid-slice, with no one to read it
        while self._idle:
            worker = self._idle.popleft()
            if worker in self._workers and not worker.busy:
                return worker
        if self.given_up or not self._workers:
            return None
        waiter: asyncio.Future[_Worker | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._release(waiter.result())  # handed over as this call was cancelled
            raise

    def _release(self, worker: _Worker) -> None:
        """A worker free for the next slice: to the first caller waiting, else idle."""
        if worker.busy or worker.dead or worker not in self._workers:
            return
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _settled(self, worker: _Worker) -> None:
        """A cancelled caller's slice is over: the worker is free, or replaced if it died."""
        if worker.dead:
            self._died(worker)
        else:
            self._release(worker)

    def _replace(self, worker: _Worker) -> None:
        # Out of the list before it is stopped: a slice that stopping fails finds it gone.
        self._workers[self._workers.index(worker)] = fresh = self._spawn()
        worker.stop(timeout=1.0)
        self._release(fresh)

    def _died(self, worker: _Worker) -> str:
        """Replace a dead worker, or give up on workers that never served."""
        if worker not in self._workers:
            return "gone"  # stopped with the others, or replaced
        if self._served:
            log.warning("a tokenizer worker process %s; starting a new one", "hung" if worker.hung else "died")
            self._replace(worker)
            return "restarted"
        log.error("tokenizer worker processes failed before serving; tokenizing on threads "
                  "(FERN_TOKENIZER_PROCESSES=0 skips them)")
        self.given_up = True
        self._stop_all()
        return "failed"

    def _stop_all(self) -> None:
        """Stop every worker (their slices fail over to the threads) and turn away the waiting."""
        workers, self._workers, self._idle = self._workers, [], deque()
        for worker in workers:
            worker.stop(timeout=1.0 if self.given_up else 10.0)
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_result(None)

    def remove(self) -> None:
        """A model's tokenizer is done with the processes; the last one stops them."""
        self._users -= 1
        if self._users <= 0 and self._workers:
            self._stop_all()
