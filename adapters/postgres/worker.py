"""The vectorizer worker: claims queued rows, embeds them on the BATCH lane, writes vectors.

Any number of workers may run against one database. Each one LISTENs for the triggers'
NOTIFY, claims queue rows with `FOR UPDATE SKIP LOCKED` (recording its connection's backend
pid, so the claims of a killed worker are free again the moment its connection is gone),
streams the texts to the sidecar through EmbedStream (a backfill keeps the GPU full while
the next batches are claimed), and, per batch, in one transaction: deletes the queue rows
and writes every vector with one statement (one UPDATE; in split mode, after locking the
parents, one DELETE of their old chunks and one INSERT of the new ones). A vectorizer with
a sparse column asks the same Embed call for sparse vectors and writes them in the same
statement; that column's triggers keep its document frequencies exact (sparse.py). Only a vector whose
text hash still matches the row's current text is written (an UPDATE that landed meanwhile
queued the row again), and only while the vectorizer's generation is the one the batch was
embedded for (a model change swapped in between).

Transient sidecar errors (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...) release
the claims and retry with exponential backoff; inputs the sidecar rejects
(INVALID_ARGUMENT) go to `fern.failed` with the error text. A vectorizer whose own SQL
fails (a source column renamed, a privilege missing) is parked: its claims are released,
its error is recorded on it (fern.status shows it), and the worker goes on with the others,
trying the parked one again after `park_retry` seconds.

Every statement that names a user's table or column is composed with `psycopg.sql` and
sent through a RawCursor with `$n` parameters, so nothing in a name (`%`, `%(x)s`, `$1`)
is ever read as a placeholder.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import psycopg
from psycopg import sql

from adapters.postgres.chunking import split_in_half, split_text
from adapters.postgres.installer import is_installed
from adapters.postgres.sparse import to_pgvector
from adapters.postgres.vectorizer import (NOTIFY_CHANNEL, Vectorizer, list_vectorizers,
                                          swap_if_ready)
from adapters.progress import Progress
from sidecar.client import Embeddings, FernClient, FernError

log = logging.getLogger("fern.pg.worker")

PERMANENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class SchemaMissing(RuntimeError):
    """The database lacks the fern schema (or has an older one)."""


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker connects and paces itself."""

    dsn: str
    target: str | None = None
    token: str | None = None
    # More FernClient keywords: TLS (tls_ca, tls_client_cert, tls_client_key, tls_server_name).
    client_options: dict = field(default_factory=dict)
    batch_size: int = 128
    # How long to sleep between passes when no NOTIFY comes (delayed retries, dead claims).
    poll_interval: float = 2.0
    min_backoff: float = 0.2
    max_backoff: float = 30.0
    progress: bool = False
    # A stream's pass ends after this many batches so other vectorizers get their turn.
    max_batches_per_pass: int = 10_000
    # How long a vectorizer whose SQL failed is skipped before it is tried again.
    park_retry: float = 60.0


@dataclass
class _Item:
    """One row: its queue entries, its key, its text and that text's md5."""

    queue_ids: list[int]
    key: list
    text: str
    present: bool
    # md5 of the text, computed by PostgreSQL (in the database's encoding) when claimed.
    text_hash: str


@dataclass
class _Batch:
    """Claimed rows of one vectorizer and the texts sent to the sidecar for them."""

    vectorizer: Vectorizer
    items: list[_Item]
    texts: list[str] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)  # texts[i] belongs to items[owner[i]]

    @property
    def queue_ids(self) -> list[int]:
        return [qid for item in self.items for qid in item.queue_ids]


@dataclass
class WorkerStats:
    """Counters a caller (or a test) can read."""

    rows_written: int = 0
    rows_stale: int = 0
    rows_failed: int = 0
    batches: int = 0
    transient_errors: int = 0
    vectorizers_parked: int = 0
    claimed_ids: list[int] = field(default_factory=list)
    record_claims: bool = False


def _raw(conn: psycopg.Connection, query: sql.Composable, params: list) -> psycopg.RawCursor:
    """Run `query` with `$n` parameters; no client-side placeholder parsing happens at all."""
    cur = psycopg.RawCursor(conn)
    cur.execute(query, params)
    return cur


def _connection_lost(*conns: psycopg.Connection | None) -> bool:
    return any(c is None or c.closed or c.broken for c in conns)


def _key_id(key: list) -> str:
    """A row key as a hashable string: the same key from fern.queue or from the table compares equal."""
    return json.dumps(key, sort_keys=True)


class Worker:
    """One worker process's loop; `run()` blocks, `stop()` (from any thread) ends it."""

    def __init__(self, config: WorkerConfig, client: FernClient | None = None):
        self.config = config
        self.client = client or FernClient(config.target, token=config.token, **config.client_options)
        self._own_client = client is None
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._backoff = 0.0
        self._claim_lock = threading.RLock()
        self._progress = Progress("fern worker", enabled=config.progress)
        self._remaining_at = 0.0  # when the queue's depth was last counted for the bar
        self._claim_conn: psycopg.Connection | None = None
        self._write_conn: psycopg.Connection | None = None

    # ----- lifecycle -----

    def stop(self) -> None:
        self._stopping.set()

    def _connect(self) -> None:
        from pgvector.psycopg import register_vector

        self._claim_conn = psycopg.connect(self.config.dsn, autocommit=True,
                                           application_name="fern-worker-claim")
        self._write_conn = psycopg.connect(self.config.dsn, autocommit=True,
                                           application_name="fern-worker-write")
        if not is_installed(self._write_conn):
            self._close()
            raise SchemaMissing("this database has no (or an older) fern schema: run "
                                "`fern pg install --dsn ...` first")
        register_vector(self._write_conn)

    def _close(self) -> None:
        for conn in (self._claim_conn, self._write_conn):
            if conn is not None:
                conn.close()
        self._claim_conn = self._write_conn = None
        self._progress.close()

    def run(self, until_empty: bool = False, timeout: float | None = None) -> None:
        """Work until stop() (or, with `until_empty`, until the queue is empty)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._connect()
        listen = psycopg.connect(self.config.dsn, autocommit=True,
                                 application_name="fern-worker-listen")
        try:
            listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(NOTIFY_CHANNEL)))
            while not self._stopping.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"worker: queue not empty after {timeout:g}s")
                done = self.run_pass()
                if until_empty and done == 0 and not self._backoff and self._queue_empty():
                    return
                if self._backoff:
                    # The sidecar is failing: wait it out instead of waking on every NOTIFY.
                    self._stopping.wait(self._backoff)
                    continue
                if done:
                    continue
                wait = 0.2 if until_empty else self.config.poll_interval
                for _ in listen.notifies(timeout=wait, stop_after=1):
                    pass
        finally:
            listen.close()
            self._close()

    def close(self) -> None:
        """Close the client this worker made (a client passed in is left open)."""
        if self._own_client:
            self.client.close()

    def _queue_empty(self) -> bool:
        """True when nothing is queued but the rows of parked vectorizers."""
        assert self._write_conn is not None
        return self._write_conn.execute(
            """SELECT NOT EXISTS (SELECT 1 FROM fern.queue q JOIN fern.vectorizers v
                                      ON v.id = q.vectorizer_id WHERE v.parked_at IS NULL)"""
        ).fetchone()[0]

    # ----- one pass over every vectorizer with claimable work -----

    def run_pass(self) -> int:
        """Process what is claimable now; returns the number of rows handled."""
        assert self._write_conn is not None
        vectorizers = {v.id: v for v in list_vectorizers(self._write_conn)}
        ids = [r[0] for r in self._write_conn.execute(
            """SELECT DISTINCT q.vectorizer_id FROM fern.queue q
                 JOIN fern.vectorizers v ON v.id = q.vectorizer_id
                WHERE (q.not_before IS NULL OR q.not_before <= now())
                  AND (v.parked_at IS NULL
                       OR v.parked_at <= now() - make_interval(secs => %s))
                  AND (q.claimed_by IS NULL OR q.claimed_by NOT IN
                       (SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL))""",
            (self.config.park_retry,))]
        done = 0
        for vid in sorted(ids):
            if self._stopping.is_set():
                break
            if vid in vectorizers:
                done += self._guarded(vectorizers[vid], self._process)
        for v in vectorizers.values():
            if v.replaces is None or self._stopping.is_set() or self._parked_now(v):
                continue
            busy = self._write_conn.execute(
                "SELECT EXISTS (SELECT 1 FROM fern.queue WHERE vectorizer_id = %s)", (v.id,))
            if not busy.fetchone()[0]:
                if self._guarded(v, self._swap):
                    log.info("model change of %s.%s to %s swapped in", v.qualified_table,
                             v.target_column, v.model)
        return done

    def _parked_now(self, v: Vectorizer) -> bool:
        if v.parked_at is None:
            return False
        return (datetime.now(timezone.utc) - v.parked_at).total_seconds() < self.config.park_retry

    def _swap(self, v: Vectorizer) -> int:
        assert self._write_conn is not None
        return int(swap_if_ready(self._write_conn, v))

    def _guarded(self, v: Vectorizer, step: Callable[[Vectorizer], int]) -> int:
        """`step(v)`, parking `v` when its SQL fails; a lost connection still ends the pass."""
        try:
            result = step(v)
        except psycopg.Error as err:
            # The database going away (OperationalError: restart, network) is the whole
            # worker's problem, not this vectorizer's: the caller reconnects.
            if (isinstance(err, (psycopg.OperationalError, psycopg.InterfaceError))
                    or _connection_lost(self._claim_conn, self._write_conn)):
                raise
            self._park(v, err)
            return 0
        if v.parked_at is not None:
            assert self._write_conn is not None
            self._write_conn.execute("UPDATE fern.vectorizers SET parked_error = NULL, "
                                     "parked_at = NULL WHERE id = %s", (v.id,))
            log.info("%s.%s works again; no longer parked", v.qualified_table, v.target_column)
        return result

    def _park(self, v: Vectorizer, err: psycopg.Error) -> None:
        """Record `err` on `v` and free its claims; the other vectorizers go on."""
        assert self._write_conn is not None
        message = f"{type(err).__name__}: {str(err).strip()}"
        self._release_mine(message)
        self._write_conn.execute("UPDATE fern.vectorizers SET parked_error = %s, parked_at = now() "
                                 "WHERE id = %s", (message, v.id))
        self.stats.vectorizers_parked += 1
        log.error("%s.%s parked for %gs (its other rows wait; the other vectorizers go on): %s",
                  v.qualified_table, v.target_column, self.config.park_retry, message)

    def _process(self, v: Vectorizer) -> int:
        """Stream every claimable batch of `v` through the sidecar; returns rows handled."""
        inflight: dict[str, _Batch] = {}
        empty: deque[_Batch] = deque()
        stream = {"open": True}
        # A claim that failed in SQL on gRPC's request thread, raised again on this one.
        claim_error: list[psycopg.Error] = []
        handled = 0

        def requests() -> Iterator[tuple[str, list[str]]]:
            # Runs on gRPC's request thread once the stream is open: claiming the next
            # batch overlaps with the sidecar embedding the previous ones.
            n = 0
            while n < self.config.max_batches_per_pass and not self._stopping.is_set():
                with self._claim_lock:
                    if not stream["open"]:
                        return
                    try:
                        batch = self._claim(v)
                    except psycopg.Error as err:
                        claim_error.append(err)
                        return
                if batch is None:
                    return
                n += 1
                if batch.texts:
                    rid = str(n)
                    inflight[rid] = batch
                    yield rid, batch.texts
                else:
                    empty.append(batch)

        def flush_empty() -> int:
            count = 0
            while empty:
                b = empty.popleft()
                count += self._write(b, None, None)
            return count

        gen = requests()
        try:
            # Claim before opening a stream: an idle pass opens none.
            try:
                first = next(gen)
            except StopIteration:
                handled = flush_empty()
                if claim_error:
                    raise claim_error[0]
                return handled

            def chained() -> Iterator[tuple[str, list[str]]]:
                yield first
                yield from gen

            # A vectorizer with a sparse column gets both vectors from the one call.
            options = {"model": v.model, "prompt": v.prompt, "truncate": True, "lane": "batch",
                       "sparse": v.sparse_column is not None}
            for result in self.client.embed_stream(chained(), **options):
                handled += flush_empty()
                batch = inflight.pop(result.request_id)
                if result.error is not None:
                    handled += self._on_request_error(batch, result.error)
                    continue
                assert result.embeddings is not None
                handled += self._write(batch, *self._finish_chunks(batch, result.embeddings))
            handled += flush_empty()
            if claim_error:
                raise claim_error[0]
            self._backoff = 0.0
        except FernError as err:
            with self._claim_lock:
                stream["open"] = False
            handled += flush_empty()
            self._on_transient_error(err)
        except BaseException:
            with self._claim_lock:
                stream["open"] = False
            self._release_mine(None)
            raise
        return handled

    # ----- claiming -----

    def _claim(self, v: Vectorizer) -> _Batch | None:
        """Claim up to batch_size queue rows of `v` and read their rows' text."""
        assert self._claim_conn is not None
        query = sql.SQL("""
            WITH c AS (
                SELECT q.id FROM fern.queue q
                 WHERE q.vectorizer_id = $1
                   AND (q.not_before IS NULL OR q.not_before <= now())
                   AND (q.claimed_by IS NULL OR q.claimed_by NOT IN
                        (SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL))
                 ORDER BY q.id LIMIT $2 FOR UPDATE SKIP LOCKED),
            u AS (
                UPDATE fern.queue q SET claimed_by = pg_backend_pid(), claimed_at = now(),
                       attempts = q.attempts + 1
                  FROM c WHERE q.id = c.id RETURNING q.id, q.row_key)
            SELECT u.id, u.row_key, t.{key} IS NOT NULL, {text}, md5({text})
              FROM u LEFT JOIN {table} t ON {match} ORDER BY u.id""").format(
            key=sql.Identifier(v.key_columns[0]),  # a primary key column: NULL only when no row
            text=v.text_sql("t"), table=v.table, match=v.key_match_sql("t", sql.SQL("u.row_key")))
        with self._claim_lock:
            rows = _raw(self._claim_conn, query, [v.id, self.config.batch_size]).fetchall()
        if not rows:
            return None
        by_key: dict[str, _Item] = {}
        for qid, key, present, text, text_hash in rows:
            k = _key_id(key)
            if k in by_key:
                by_key[k].queue_ids.append(qid)
            else:
                by_key[k] = _Item([qid], key, text or "", bool(present), text_hash)
        if self.stats.record_claims:
            self.stats.claimed_ids.extend(r[0] for r in rows)
        batch = _Batch(v, list(by_key.values()))
        for n, item in enumerate(batch.items):
            if not item.present or not item.text.strip():
                continue
            if v.chunking == "split":
                assert v.chunk_tokens is not None and v.chunk_overlap is not None
                for chunk in split_text(item.text, v.chunk_tokens, v.chunk_overlap):
                    batch.texts.append(chunk)
                    batch.owner.append(n)
            else:
                batch.texts.append(item.text)
                batch.owner.append(n)
        return batch

    def _release(self, queue_ids: list[int], error: str | None, delay: float) -> None:
        assert self._write_conn is not None
        self._write_conn.execute(
            """UPDATE fern.queue SET claimed_by = NULL, claimed_at = NULL, last_error = %s,
                      not_before = CASE WHEN %s > 0 THEN now() + make_interval(secs => %s) END
                WHERE id = ANY(%s)""", (error, delay, delay, queue_ids))

    # ----- results -----

    def _finish_chunks(self, batch: _Batch, emb: Embeddings) -> tuple[np.ndarray, list | None]:
        """Vectors (and sparse vectors, as pgvector's, when the vectorizer keeps them) for
        batch.texts; in split mode, chunks the sidecar had to cut are re-split."""
        vectors = np.asarray(emb.vectors, dtype=np.float32)
        v = batch.vectorizer
        sparse = None
        if v.sparse_column is not None:
            if emb.sparse is None:
                raise FernError(grpc.StatusCode.INTERNAL, "the sidecar returned no sparse vectors")
            sparse = [to_pgvector(sv) for sv in emb.sparse]
        if v.chunking != "split":
            return vectors, sparse
        limit = v.max_tokens
        counts = list(emb.token_counts)
        texts, owner, rows = list(batch.texts), list(batch.owner), list(vectors)
        sparse_rows: list = list(sparse) if sparse is not None else [None] * len(texts)
        for _ in range(8):
            over = [i for i, c in enumerate(counts) if c >= limit]
            if not over:
                break
            new_texts, new_owner, new_rows, new_counts, new_sparse = [], [], [], [], []
            redo: list[int] = []
            for i, t in enumerate(texts):
                if i in over:
                    for half in split_in_half(t):
                        redo.append(len(new_texts))
                        new_texts.append(half)
                        new_owner.append(owner[i])
                        new_rows.append(None)
                        new_counts.append(0)
                        new_sparse.append(None)
                else:
                    new_texts.append(t)
                    new_owner.append(owner[i])
                    new_rows.append(rows[i])
                    new_counts.append(counts[i])
                    new_sparse.append(sparse_rows[i])
            again = self.client.embed([new_texts[i] for i in redo], model=v.model,
                                      prompt=v.prompt, lane="batch", truncate=True,
                                      sparse=sparse is not None)
            for j, i in enumerate(redo):
                new_rows[i] = again.vectors[j]
                new_counts[i] = int(again.token_counts[j])
                if again.sparse is not None:
                    new_sparse[i] = to_pgvector(again.sparse[j])
            texts, owner, rows, counts, sparse_rows = (new_texts, new_owner, new_rows, new_counts,
                                                       new_sparse)
        batch.texts, batch.owner = texts, owner
        return np.stack(rows).astype(np.float32), (sparse_rows if sparse is not None else None)

    def _write(self, batch: _Batch, vectors: np.ndarray | None, sparse: list | None = None) -> int:
        """Delete the batch's queue rows and write its vectors (and sparse vectors), in one
        transaction; the sparse column's triggers update its document frequencies in it too."""
        v = batch.vectorizer
        conn = self._write_conn
        assert conn is not None
        with conn.transaction():
            row = conn.execute("SELECT generation FROM fern.vectorizers WHERE id = %s FOR SHARE",
                               (v.id,)).fetchone()
            if row is None:
                return len(batch.items)  # the vectorizer was dropped; its queue went with it
            if row[0] != v.generation:
                # The model changed while these were embedded: embed them again.
                conn.execute("UPDATE fern.queue SET claimed_by = NULL WHERE id = ANY(%s)",
                             (batch.queue_ids,))
                return 0
            conn.execute("DELETE FROM fern.queue WHERE id = ANY(%s)", (batch.queue_ids,))
            present = [it for it in batch.items if it.present]
            if v.chunking == "split":
                written = self._write_chunks(conn, batch, present, vectors, sparse)
            else:
                written = self._write_rows(conn, batch, present, vectors, sparse)
        self.stats.rows_written += written
        self.stats.rows_stale += len(present) - written
        self.stats.batches += 1
        if self._progress.enabled:
            self._progress.advance(len(batch.items), self._remaining())
        return len(batch.items)

    def _write_rows(self, conn: psycopg.Connection, batch: _Batch, present: list[_Item],
                    vectors: np.ndarray | None, sparse: list | None) -> int:
        v = batch.vectorizer
        if not present:
            return 0
        # One text per row here, so owner maps each vector to its item; rows that sent no
        # text (blank) get NULL.
        by_item = {} if vectors is None else dict(zip(batch.owner, vectors))
        keys = [json.dumps(it.key) for it in present]
        hashes = [it.text_hash for it in present]
        vecs = [by_item.get(n) for n, it in enumerate(batch.items) if it.present]
        if v.sparse_column is not None:
            sparse_by_item = {} if sparse is None else dict(zip(batch.owner, sparse))
            svecs = [sparse_by_item.get(n) for n, it in enumerate(batch.items) if it.present]
            cur = _raw(conn, sql.SQL(
                """UPDATE {table} t SET {col} = u.v, {scol} = u.s
                     FROM unnest($1::jsonb[], $2::text[], $3::vector[], $4::sparsevec[])
                          AS u(k, h, v, s)
                    WHERE {match} AND md5({text}) = u.h""").format(
                table=v.table, col=sql.Identifier(v.target_column),
                scol=sql.Identifier(v.sparse_column),
                match=v.key_match_sql("t", sql.SQL("u.k")), text=v.text_sql("t")),
                [keys, hashes, vecs, svecs])
            return cur.rowcount
        cur = _raw(conn, sql.SQL(
            """UPDATE {table} t SET {col} = u.v
                 FROM unnest($1::jsonb[], $2::text[], $3::vector[]) AS u(k, h, v)
                WHERE {match} AND md5({text}) = u.h""").format(
            table=v.table, col=sql.Identifier(v.target_column),
            match=v.key_match_sql("t", sql.SQL("u.k")), text=v.text_sql("t")),
            [keys, hashes, vecs])
        return cur.rowcount

    def _write_chunks(self, conn: psycopg.Connection, batch: _Batch, present: list[_Item],
                      vectors: np.ndarray | None, sparse: list | None) -> int:
        v = batch.vectorizer
        if not present:
            return 0
        keys = [json.dumps(it.key) for it in present]
        hashes = [it.text_hash for it in present]
        # Lock the parents whose text is still what was embedded; the rest were updated
        # meanwhile and are queued again.
        current = _raw(conn, sql.SQL(
            """SELECT u.k FROM {table} t
                 JOIN unnest($1::jsonb[], $2::text[]) AS u(k, h) ON {match}
                WHERE md5({text}) = u.h FOR NO KEY UPDATE OF t""").format(
            table=v.table, match=v.key_match_sql("t", sql.SQL("u.k")), text=v.text_sql("t")),
            [keys, hashes]).fetchall()
        fresh = {_key_id(r[0]) for r in current}
        if not fresh:
            return 0
        # The key (as sent to SQL) of each item still fresh, by item index: once per row,
        # not once per chunk.
        fresh_keys = {n: json.dumps(it.key) for n, it in enumerate(batch.items)
                      if it.present and _key_id(it.key) in fresh}
        _raw(conn, sql.SQL("DELETE FROM {chunks} c USING unnest($1::jsonb[]) AS u(k) "
                           "WHERE {match}").format(
            chunks=v.chunks, match=v.key_match_sql("c", sql.SQL("u.k"))),
            [list(fresh_keys.values())])
        if vectors is not None and len(batch.texts):
            c_keys, c_idx, c_text, c_vec, c_sparse = [], [], [], [], []
            next_index: dict[int, int] = {}
            for i, n in enumerate(batch.owner):
                if n not in fresh_keys:
                    continue
                c_keys.append(fresh_keys[n])
                c_idx.append(next_index.get(n, 0))
                next_index[n] = next_index.get(n, 0) + 1
                c_text.append(batch.texts[i])
                c_vec.append(vectors[i])
                if sparse is not None:
                    c_sparse.append(sparse[i])
            key_cols = sql.SQL(", ").join(map(sql.Identifier, v.key_columns))
            key_vals = sql.SQL(", ").join(
                sql.SQL("(u.k ->> {})::{}").format(sql.Literal(n), sql.SQL(t))
                for n, t in enumerate(v.key_types))
            if v.sparse_column is not None and sparse is not None:
                _raw(conn, sql.SQL(
                    """INSERT INTO {chunks} ({keys}, chunk_index, chunk_text, {col}, {scol})
                       SELECT {vals}, u.i, u.txt, u.v, u.s
                         FROM unnest($1::jsonb[], $2::int[], $3::text[], $4::vector[],
                                     $5::sparsevec[]) AS u(k, i, txt, v, s)""").format(
                    chunks=v.chunks, keys=key_cols, col=sql.Identifier(v.target_column),
                    scol=sql.Identifier(v.sparse_column), vals=key_vals),
                    [c_keys, c_idx, c_text, c_vec, c_sparse])
            else:
                _raw(conn, sql.SQL(
                    """INSERT INTO {chunks} ({keys}, chunk_index, chunk_text, {col})
                       SELECT {vals}, u.i, u.txt, u.v
                         FROM unnest($1::jsonb[], $2::int[], $3::text[], $4::vector[])
                              AS u(k, i, txt, v)""").format(
                    chunks=v.chunks, keys=key_cols, col=sql.Identifier(v.target_column),
                    vals=key_vals), [c_keys, c_idx, c_text, c_vec])
        return len(fresh)

    def _remaining(self) -> int | None:
        now = time.monotonic()
        if now - self._remaining_at < 0.2:
            return None
        self._remaining_at = now
        assert self._write_conn is not None
        return self._write_conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0]

    # ----- errors -----

    def _on_request_error(self, batch: _Batch, err: FernError) -> int:
        """A request the sidecar rejected: park the offending row(s), retry the rest."""
        if err.code not in PERMANENT_CODES:
            self._release(batch.queue_ids, f"{err.code.name}: {err.message}", 0.0)
            self.stats.transient_errors += 1
            self._backoff = max(self.config.min_backoff, self._backoff)
            return 0
        if err.index is not None and 0 <= err.index < len(batch.owner):
            bad = {batch.owner[err.index]}
        else:
            bad = set(batch.owner)  # the request as a whole: every row that sent text
        failed = [batch.items[n] for n in sorted(bad)]
        retry = [qid for n, it in enumerate(batch.items) if n not in bad for qid in it.queue_ids]
        conn = self._write_conn
        assert conn is not None
        with conn.transaction():
            for item in failed:
                conn.execute("""INSERT INTO fern.failed (vectorizer_id, row_key, error, attempts)
                                SELECT %s, %s::jsonb, %s, coalesce(max(attempts), 1)
                                  FROM fern.queue WHERE id = ANY(%s)""",
                             (batch.vectorizer.id, json.dumps(item.key), err.message,
                              item.queue_ids))
                conn.execute("DELETE FROM fern.queue WHERE id = ANY(%s)", (item.queue_ids,))
            if retry:
                self._release(retry, None, 0.0)
        self.stats.rows_failed += len(failed)
        log.warning("%s: %d row(s) rejected by the sidecar: %s", batch.vectorizer.qualified_table,
                    len(failed), err.message)
        return len(failed)

    def _on_transient_error(self, err: FernError) -> None:
        self.stats.transient_errors += 1
        self._backoff = min(self.config.max_backoff,
                            max(self.config.min_backoff, self._backoff * 2))
        self._release_mine(f"{err.code.name}: {err.message}")
        log.warning("sidecar error (%s); retrying in %.1fs", err, self._backoff)

    def _release_mine(self, error: str | None) -> None:
        """Release every claim this worker holds (batches claimed, sent or not)."""
        if self._claim_conn is None or self._claim_conn.closed:
            return
        with self._claim_lock:
            self._claim_conn.execute(
                """UPDATE fern.queue SET claimed_by = NULL, claimed_at = NULL,
                          last_error = coalesce(%s, last_error)
                    WHERE claimed_by = pg_backend_pid()""", (error,))


class BackgroundWorker:
    """A Worker in a daemon thread, e.g. inside `fern serve --pg-worker-dsn DSN`."""

    def __init__(self, dsn: str, target: str | None = None, **config: Any):
        self.worker = Worker(WorkerConfig(dsn=dsn, target=target, **config))
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fern-pg-worker", daemon=True)

    def _run(self) -> None:
        while not self.worker._stopping.is_set():
            try:
                self.worker.run()
            except (psycopg.Error, SchemaMissing) as err:
                # The database went away or is not installed yet: keep the sidecar up and
                # try again (installing the schema later is enough).
                self.error = err
                log.warning("pg worker: %s; retrying in 5 s", err)
                self.worker._stopping.wait(5.0)
            except BaseException as err:
                self.error = err
                log.exception("pg worker stopped")
                raise
        self.worker.close()

    def start(self) -> "BackgroundWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.worker.stop()
        self._thread.join(timeout)


def start_background_worker(dsn: str, target: str | None = None,
                            **config: Any) -> BackgroundWorker:
    """Start a worker thread; call `.stop()` on shutdown."""
    return BackgroundWorker(dsn, target, **config).start()
