"""A Postgres backfill spread over two sidecars by two workers, one sidecar SIGKILLed halfway:
every row embedded once, with the vector the surviving sidecar gives its text."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "postgres"))
from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: E402,F401
from pg_helpers import cosines  # noqa: E402

from adapters.postgres.vectorizer import create_vectorizer  # noqa: E402
from adapters.postgres.worker import Worker, WorkerConfig  # noqa: E402
from sidecar.client import FernClient  # noqa: E402

ROWS = 20_000
WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor"]


def text_for(i: int) -> str:
    return f"{i} {WORDS[i % 8]}"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_two_workers_over_two_sidecars_survive_losing_one(conn, pg_db, sidecar_factory):
    conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
    with conn.cursor().copy("COPY items (id, body) FROM STDIN") as copy:
        for i in range(ROWS):
            copy.write_row((i, text_for(i)))
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
        wait_for(lambda: embedded() >= ROWS // 2, 600, "half the rows")
        sidecars[0].kill()
        at_kill = embedded()
        assert at_kill < ROWS, "the backfill finished before the kill: nothing was tested"
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
    assert sum(w.stats.rows_written for w in workers) == ROWS
    assert sum(w.stats.rows_stale + w.stats.rows_failed for w in workers) == 0
    assert all(w.stats.rows_written > 0 for w in workers), "one worker took every row"
    assert conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0] == 0
    ids, texts, vectors = [], [], []
    for i, body, vec in conn.execute("SELECT id, body, embedding FROM items ORDER BY id"):
        ids.append(i)
        texts.append(body)
        vectors.append(np.asarray(vec.to_numpy() if hasattr(vec, "to_numpy") else vec, dtype=np.float32))
    assert ids == list(range(ROWS))
    with FernClient(sidecars[1].target, timeout=300) as survivor:
        want = np.concatenate([survivor.embed(texts[i:i + 4096], prompt="passage", lane="batch").vectors
                               for i in range(0, ROWS, 4096)])
    sims = cosines(np.stack(vectors), want)
    assert sims.min() >= 0.99999, f"row {int(sims.argmin())}: cosine {sims.min():.6f}"
