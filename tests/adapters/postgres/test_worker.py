"""Workers against a real PostgreSQL and a real sidecar: correctness, staleness, failures, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psycopg
import pytest
from pg_helpers import cosines, fetch_vectors, free_port, run_worker

from adapters.postgres.status import status
from adapters.postgres.vectorizer import create_vectorizer
from adapters.postgres.worker import Worker, WorkerConfig

WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
         "juniper", "kelp", "lagoon", "meadow", "nickel", "orchid", "prairie", "quartz"]


def text_for(i: int) -> str:
    return f"note {i}: {WORDS[i % 17]} {WORDS[(i // 17) % 17]} {WORDS[(i // 289) % 17]}"


def reference(fern, texts: list[str], prompt: str | None) -> np.ndarray:
    out = [fern.embed(texts[i:i + 1000], lane="batch", prompt=prompt).vectors
           for i in range(0, len(texts), 1000)]
    return np.concatenate(out)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_exactly_committed_rows_get_the_sidecars_vectors(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    v = create_vectorizer(conn, "items", ["body"], client=fern)
    worker = Worker(WorkerConfig(dsn=pg_db, target=pg_target, poll_interval=0.5))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    committed: list[int] = []
    try:
        with psycopg.connect(pg_db) as writer:  # not autocommit: explicit transactions
            for tx in range(10):
                ids = list(range(tx * 1000, (tx + 1) * 1000))
                with writer.cursor() as cur:
                    cur.executemany("INSERT INTO items VALUES (%s, %s)",
                                    [(i, text_for(i)) for i in ids])
                if tx in (3, 7):
                    writer.rollback()
                else:
                    writer.commit()
                    committed += ids
        wait_for(lambda: conn.execute("SELECT NOT EXISTS (SELECT 1 FROM fern.queue)")
                 .fetchone()[0], 600, "the queue to drain")
    finally:
        worker.stop()
        thread.join(30)
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items "
                                    "WHERE embedding IS NOT NULL ORDER BY id")
    assert ids == committed
    assert conn.execute("SELECT count(*) FROM items").fetchone() == (8000,)
    assert conn.execute("SELECT count(*) FROM fern.failed").fetchone() == (0,)
    ref = reference(fern, [text_for(i) for i in ids], v.prompt)
    sims = cosines(vecs, ref)
    assert sims.min() >= 0.99999, f"worst row {ids[int(sims.argmin())]}: cosine {sims.min()}"


def test_source_update_while_embedding_is_in_flight_ends_with_new_text(conn, fern, pg_db,
                                                                        pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO items VALUES (1, 'the old text about apples')")
    v = create_vectorizer(conn, "items", ["body"], client=fern)
    worker = Worker(WorkerConfig(dsn=pg_db, target=pg_target), client=fern)
    worker._connect()
    try:
        batch = worker._claim(v)  # claimed and read: the embedding is now "in flight"
        assert batch is not None and batch.texts == ["the old text about apples"]
        conn.execute("UPDATE items SET body = 'the new text about pears' WHERE id = 1")
        old = fern.embed(batch.texts, lane="batch", prompt=v.prompt).vectors
        worker._write(batch, old)
        assert worker.stats.rows_stale == 1
        assert conn.execute("SELECT embedding IS NULL FROM items").fetchone() == (True,)
    finally:
        worker._close()
    run_worker(pg_db, pg_target)
    (_,), vec = fetch_vectors(conn, "SELECT id, embedding FROM items")
    new = fern.embed(["the new text about pears"], prompt=v.prompt).vectors
    assert cosines(vec, new)[0] >= 0.99999
    assert cosines(vec, old)[0] < 0.99


def test_rejected_inputs_go_to_failed_table_and_empty_text_gets_no_vector(conn, fern, pg_db,
                                                                           pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO items VALUES (1, 'fine'), (2, NULL), (3, '   ')")
    create_vectorizer(conn, "items", ["body"], client=fern, prompt="no-such-prompt")
    worker = run_worker(pg_db, pg_target)
    assert worker.stats.rows_failed == 1
    failed = conn.execute("SELECT row_key, error FROM fern.failed").fetchall()
    assert [f[0] for f in failed] == [[1]]
    assert "no-such-prompt" in failed[0][1]
    (st,) = status(conn)
    assert (st.pending, st.in_flight, st.failed) == (0, 0, 1)
    assert "no-such-prompt" in st.last_error
    assert conn.execute("SELECT count(*) FROM items WHERE embedding IS NOT NULL").fetchone() == (0,)


@pytest.mark.slow
def test_sidecar_down_writes_commit_queue_grows_then_drains(conn, fern, pg_db, sidecar_factory):
    port = free_port()
    side = sidecar_factory("--port", str(port))
    target = f"127.0.0.1:{port}"
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    v = create_vectorizer(conn, "items", ["body"], client=fern)
    worker = Worker(WorkerConfig(dsn=pg_db, target=target, poll_interval=0.2, max_backoff=1.0))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        conn.execute("INSERT INTO items SELECT g, 'first ' || g FROM generate_series(1, 50) g")
        wait_for(lambda: conn.execute("SELECT count(embedding) FROM items").fetchone()[0] == 50,
                 120, "the first rows' vectors")
        side.terminate()
        for n in range(5):  # writes keep committing, one transaction each
            conn.execute("INSERT INTO items SELECT g, 'second ' || g "
                         "FROM generate_series(%s::int, %s::int) g", (100 + n * 20, 119 + n * 20))
        wait_for(lambda: worker.stats.transient_errors > 0, 60, "the worker to notice")
        (st,) = [s for s in status(conn) if s.vectorizer_id == v.id]
        assert st.pending + st.in_flight == 100
        assert conn.execute("SELECT count(embedding) FROM items").fetchone() == (50,)
        sidecar_factory("--port", str(port))
        wait_for(lambda: conn.execute("SELECT NOT EXISTS (SELECT 1 FROM fern.queue)").fetchone()[0],
                 120, "the queue to drain after the sidecar came back")
    finally:
        worker.stop()
        thread.join(30)
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items ORDER BY id")
    assert len(ids) == 150
    texts = conn.execute("SELECT body FROM items ORDER BY id").fetchall()
    ref = fern.embed([t[0] for t in texts], prompt=v.prompt).vectors
    assert cosines(vecs, ref).min() >= 0.99999


def _worker_cmd(dsn: str, target: str, batch: int) -> list[str]:
    return [sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", dsn, "--target",
            target, "--batch-size", str(batch), "--progress", "off"]


@pytest.mark.slow
def test_worker_killed_mid_batch_loses_nothing_and_writes_nothing_wrong(conn, fern, pg_db,
                                                                         pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO items SELECT g, 'row ' || g || ' of the crash test' "
                 "FROM generate_series(1, 3000) g")
    v = create_vectorizer(conn, "items", ["body"], client=fern)
    proc = subprocess.Popen(_worker_cmd(pg_db, pg_target, 64), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: conn.execute("SELECT count(embedding) FROM items").fetchone()[0] >= 200,
                 120, "the worker to make progress")
        wait_for(lambda: status(conn)[0].in_flight > 0, 30, "rows in flight to kill it on")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    done = conn.execute("SELECT count(embedding) FROM items").fetchone()[0]
    assert done < 3000, "the worker finished before it was killed: nothing was tested"
    # Its claims are free as soon as its connections are gone.
    wait_for(lambda: status(conn)[0].in_flight == 0, 30, "the dead worker's claims to free")
    assert status(conn)[0].pending + done >= 3000
    run_worker(pg_db, pg_target)
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items ORDER BY id")
    assert ids == list(range(1, 3001))
    ref = reference(fern, [f"row {i} of the crash test" for i in ids], v.prompt)
    assert cosines(vecs, ref).min() >= 0.99999


@pytest.mark.slow
def test_two_workers_share_a_backfill_with_disjoint_claims(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO items VALUES (%s, %s)", [(i, text_for(i)) for i in range(10_000)])
    v = create_vectorizer(conn, "items", ["body"], client=fern)
    assert v.backfilled == 10_000
    all_ids = {r[0] for r in conn.execute("SELECT id FROM fern.queue")}
    workers = [Worker(WorkerConfig(dsn=pg_db, target=pg_target, batch_size=64)) for _ in range(2)]
    for w in workers:
        w.stats.record_claims = True
    threads = [threading.Thread(target=w.run, kwargs={"until_empty": True, "timeout": 600})
               for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = (set(w.stats.claimed_ids) for w in workers)
    assert a and b, "both workers must have claimed work"
    assert not a & b
    assert a | b == all_ids
    assert conn.execute("SELECT count(embedding) FROM items").fetchone() == (10_000,)
    sample = list(range(0, 10_000, 37))
    ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM items WHERE id = ANY(%s) ORDER BY id",
                              (sample,))
    ref = reference(fern, [text_for(i) for i in ids], v.prompt)
    assert cosines(vecs, ref).min() >= 0.99999
