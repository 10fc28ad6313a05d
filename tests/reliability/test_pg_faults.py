"""Faults under a running worker (sidecar SIGKILL, PostgreSQL restart, worker SIGKILL, key and
text updates racing the backfill, one of two sidecars lost under two workers), each audited to
0 rows lost, stale or duplicated.

Every table has two vectorizers, one vector per row (`embedding`) and split chunks
(`chunked`, several chunks for every tenth row), so the audit counts, after the queue has
drained: lost (a row with text but no vector, or no chunks), stale (a vector, or a chunk
set, that is not the current text's) and duplicated (chunk rows beyond the current text's
chunks, or of a key no row has). With FERN_FAULTS_JSON=PATH the figures go to PATH:

    FERN_FAULTS_JSON=benchmarks/results/cpu/faults.json python -m pytest -q tests/reliability/test_pg_faults.py
"""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "postgres"))
from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: E402,F401
from pg_helpers import cosines, free_port, run_worker  # noqa: E402

from adapters.postgres.chunking import split_text  # noqa: E402
from adapters.postgres.embedded import EmbeddedPostgres  # noqa: E402
from adapters.postgres.installer import install  # noqa: E402
from adapters.postgres.status import status  # noqa: E402
from adapters.postgres.vectorizer import create_vectorizer  # noqa: E402
from adapters.postgres.worker import Worker, WorkerConfig  # noqa: E402
from sidecar.client import FernClient  # noqa: E402

WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
         "juniper", "kelp", "lagoon", "meadow", "nickel", "orchid", "prairie", "quartz"]
CHUNK_TOKENS, CHUNK_OVERLAP = 64, 8
FIGURES: dict[str, dict] = {}


def text_for(i: int, version: int = 0) -> str:
    words = [WORDS[(i * 7 + j * 3 + version) % 17] for j in range(100 if i % 10 == 0 else 8)]
    return f"row {i} v{version}: " + " ".join(words)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def setup_table(conn: psycopg.Connection, fern, rows: int) -> None:
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO items VALUES (%s, %s)",
                        [(i, text_for(i)) for i in range(rows)])
    create_vectorizer(conn, "items", ["body"], client=fern)
    create_vectorizer(conn, "items", ["body"], client=fern, target_column="chunked",
                      chunking="split", chunk_tokens=CHUNK_TOKENS, chunk_overlap=CHUNK_OVERLAP)


def embedded_rows(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(embedding) FROM items").fetchone()[0]


def queue_empty(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM fern.queue)").fetchone()[0]


def _vec(v) -> np.ndarray:
    return np.asarray(v.to_numpy() if hasattr(v, "to_numpy") else v, dtype=np.float32)


def audit(conn: psycopg.Connection, fern) -> dict[str, int]:
    """Rows lost, stale and duplicated, against the sidecar's vectors for the current texts."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    rows = dict(conn.execute("SELECT id, body FROM items").fetchall())
    vectors = dict(conn.execute("SELECT id, embedding FROM items").fetchall())
    chunks: dict[int, list[tuple[int, str, object]]] = {}
    for key, index, text, vec in conn.execute(
            "SELECT id, chunk_index, chunk_text, chunked FROM items_chunked_chunks ORDER BY 1, 2"):
        chunks.setdefault(key, []).append((index, text, vec))
    lost = stale = duplicated = 0
    ids = sorted(rows)
    ref = fern.embed([rows[i] for i in ids], prompt="passage").vectors
    have = [i for i in ids if vectors[i] is not None]
    lost += len(ids) - len(have)
    if have:
        sims = cosines(np.stack([_vec(vectors[i]) for i in have]),
                       ref[[ids.index(i) for i in have]])
        stale += int((sims < 0.99999).sum())
    duplicated += sum(len(c) for k, c in chunks.items() if k not in rows)
    texts, vecs = [], []
    for i in ids:
        want = split_text(rows[i], CHUNK_TOKENS, CHUNK_OVERLAP)
        got = chunks.get(i, [])
        if not got:
            lost += 1
            continue
        duplicated += max(0, len(got) - len(want))
        if [t for _, t, _ in got] != want or [n for n, _, _ in got] != list(range(len(got))):
            stale += 1
            continue
        texts += want
        vecs += [_vec(v) for _, _, v in got]
    if texts:
        chunk_ref = fern.embed(texts, prompt="passage").vectors
        stale += int((cosines(np.stack(vecs), chunk_ref) < 0.99999).sum() > 0)
    return {"rows": len(rows), "lost": lost, "stale": stale, "duplicated": duplicated}


def record(name: str, figures: dict[str, int], recover_s: float, **extra) -> None:
    FIGURES[name] = {**figures, "seconds_to_recover": round(recover_s, 2), **extra}
    assert (figures["lost"], figures["stale"], figures["duplicated"]) == (0, 0, 0), figures


@pytest.fixture(scope="module", autouse=True)
def write_figures():
    yield
    path = os.environ.get("FERN_FAULTS_JSON")
    if path and FIGURES:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({
            "command": "FERN_FAULTS_JSON=benchmarks/results/cpu/faults.json "
                       "python -m pytest -q tests/reliability/test_pg_faults.py",
            "what": "rows audited after each fault once the queue drained: lost, stale, "
                    "duplicated (goal 0 each); seconds_to_recover from the fault's end to an "
                    "empty queue; CPU sidecar with the bundled model, embedded PostgreSQL 18",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "faults": FIGURES}, indent=2) + "\n")


def _background(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_sidecar_sigkill_mid_backfill(conn, fern, pg_db, sidecar_factory):
    setup_table(conn, fern, 300)
    port = free_port()
    side = sidecar_factory("--port", str(port))
    worker = Worker(WorkerConfig(dsn=pg_db, target=f"127.0.0.1:{port}", batch_size=32,
                                 poll_interval=0.2, max_backoff=1.0))
    thread = _background(worker)
    try:
        wait_for(lambda: embedded_rows(conn) >= 20, 120, "the backfill to start")
        side.kill()
        done_at_kill = embedded_rows(conn)
        assert done_at_kill < 300, "the backfill finished before the kill: nothing was tested"
        wait_for(lambda: worker.stats.transient_errors > 0, 60, "the worker to notice")
        sidecar_factory("--port", str(port))
        start = time.monotonic()
        wait_for(lambda: queue_empty(conn), 300, "the queue to drain")
        recover = time.monotonic() - start
    finally:
        worker.stop()
        thread.join(30)
        worker.close()
    record("sidecar_sigkill_mid_backfill", audit(conn, fern), recover,
           embedded_at_fault=done_at_kill)


def _cli_worker(dsn: str, target: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", dsn,
                             "--target", target, "--batch-size", "16", "--progress", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
def test_postgres_restart_under_a_worker(fern, pg_target):
    # Commits durable when acknowledged, as in production (the fixture's server trades that
    # for speed): the restart must then keep every vector written before it.
    with EmbeddedPostgres(settings={"synchronous_commit": "on"}) as pg:
        own = psycopg.connect(pg.dsn, autocommit=True)
        install(own)
        setup_table(own, fern, 300)
        proc = _cli_worker(pg.dsn, pg_target)
        try:
            wait_for(lambda: embedded_rows(own) >= 30, 120, "the worker to make progress")
            before = embedded_rows(own)
            own.close()
            pg.restart_after_crash()
            start = time.monotonic()
            own = psycopg.connect(pg.dsn, autocommit=True)
            done_at_fault = embedded_rows(own)
            assert before <= done_at_fault < 300, (before, done_at_fault)
            own.execute("INSERT INTO items SELECT g, 'after the restart ' || g "
                        "FROM generate_series(1000, 1099) g")
            wait_for(lambda: queue_empty(own), 300, "the queue to drain after the restart")
            recover = time.monotonic() - start
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        finally:
            _kill(proc)
        figures = audit(own, fern)
        own.close()
    assert figures["rows"] == 400
    record("postgres_restart_under_a_worker", figures, recover, embedded_at_fault=done_at_fault)


def test_worker_sigkill_holding_claims(conn, fern, pg_db, pg_target):
    setup_table(conn, fern, 300)
    proc = _cli_worker(pg_db, pg_target)
    try:
        wait_for(lambda: embedded_rows(conn) >= 30, 120, "the worker to make progress")
        wait_for(lambda: sum(s.in_flight for s in status(conn)) > 0, 60, "claims to kill it on")
        held = sum(s.in_flight for s in status(conn))
        _kill(proc)
    finally:
        _kill(proc)
    start = time.monotonic()
    wait_for(lambda: sum(s.in_flight for s in status(conn)) == 0, 30, "the claims to free")
    run_worker(pg_db, pg_target, timeout=300)
    record("worker_sigkill_holding_claims", audit(conn, fern), time.monotonic() - start,
           claims_held_at_kill=held)


def test_key_and_text_updates_racing_a_two_worker_backfill(conn, fern, pg_db, pg_target):
    setup_table(conn, fern, 300)
    workers = [Worker(WorkerConfig(dsn=pg_db, target=pg_target, batch_size=16,
                                   poll_interval=0.2)) for _ in range(2)]
    threads = [_background(w) for w in workers]
    rng = random.Random(24)
    updates = {"text": 0, "key": 0}
    try:
        with psycopg.connect(pg_db, autocommit=True) as writer:
            next_key = 10_000
            for rnd in range(25):
                ids = [r[0] for r in writer.execute("SELECT id FROM items")]
                for i in rng.sample(ids, 5):
                    writer.execute("UPDATE items SET body = %s WHERE id = %s",
                                   (text_for(i, rnd + 1), i))
                    updates["text"] += 1
                for i in rng.sample(ids, 3):
                    writer.execute("UPDATE items SET id = %s WHERE id = %s", (next_key, i))
                    next_key += 1
                    updates["key"] += 1
                # Text and key in one statement, too.
                i = rng.choice(ids)
                writer.execute("UPDATE items SET id = %s, body = %s WHERE id = %s",
                               (next_key, text_for(next_key, rnd), i))
                next_key += 1
                updates["key"] += 1
                time.sleep(0.05)
        start = time.monotonic()
        wait_for(lambda: queue_empty(conn), 300, "the queue to drain")
        recover = time.monotonic() - start
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
        for w in workers:
            w.close()
    record("key_and_text_updates_racing_backfill", audit(conn, fern), recover,
           text_updates=updates["text"], key_updates=updates["key"], workers=2)


# ----------------------------------------------------------------------------- two sidecars

BACKFILL_ROWS = 20_000


def short_text(i: int) -> str:
    return f"{i} {WORDS[i % 8]}"


@pytest.mark.slow
def test_two_workers_over_two_sidecars_survive_losing_one(conn, pg_db, sidecar_factory):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    with conn.cursor().copy("COPY items (id, body) FROM STDIN") as copy:
        for i in range(BACKFILL_ROWS):
            copy.write_row((i, short_text(i)))
    sidecars = [sidecar_factory(), sidecar_factory()]
    targets = ",".join(s.target for s in sidecars)
    with FernClient(targets) as client:
        create_vectorizer(conn, "items", ["body"], client=client)
    workers = [Worker(WorkerConfig(dsn=pg_db, target=targets, batch_size=256, poll_interval=0.2,
                                   max_backoff=1.0)) for _ in range(2)]
    threads = [threading.Thread(target=w.run, kwargs={"until_empty": True, "timeout": 900}, daemon=True)
               for w in workers]
    for thread in threads:
        thread.start()
    embedded = lambda: conn.execute("SELECT count(embedding) FROM items").fetchone()[0]  # noqa: E731
    try:
        wait_for(lambda: embedded() >= BACKFILL_ROWS // 2, 600, "half the rows")
        sidecars[0].kill()
        at_kill = embedded()
        assert at_kill < BACKFILL_ROWS, "the backfill finished before the kill: nothing was tested"
        for thread in threads:
            thread.join(900)
        assert not any(t.is_alive() for t in threads), "the workers did not drain the queue"
    finally:
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(30)
        for worker in workers:
            worker.close()

    # Every row written once: the workers' writes add up to the table, none stale or failed.
    assert sum(w.stats.rows_written for w in workers) == BACKFILL_ROWS
    assert sum(w.stats.rows_stale + w.stats.rows_failed for w in workers) == 0
    assert all(w.stats.rows_written > 0 for w in workers), "one worker took every row"
    assert conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0] == 0
    ids, texts, vectors = [], [], []
    for i, body, vec in conn.execute("SELECT id, body, embedding FROM items ORDER BY id"):
        ids.append(i)
        texts.append(body)
        vectors.append(np.asarray(vec.to_numpy() if hasattr(vec, "to_numpy") else vec, dtype=np.float32))
    assert ids == list(range(BACKFILL_ROWS))
    with FernClient(sidecars[1].target, timeout=300) as survivor:
        want = np.concatenate([survivor.embed(texts[i:i + 4096], prompt="passage", lane="batch").vectors
                               for i in range(0, BACKFILL_ROWS, 4096)])
    sims = cosines(np.stack(vectors), want)
    assert sims.min() >= 0.99999, f"row {int(sims.argmin())}: cosine {sims.min():.6f}"
