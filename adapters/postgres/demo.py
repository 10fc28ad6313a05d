"""`fern demo`'s database part: plain SQL writes get vectors by themselves; hybrid search finds them."""

from __future__ import annotations

import time

ARTICLES = [
    ("Night trains are back", "Sleeper services link Vienna, Venice and Paris again."),
    ("How to repot a cactus", "Wear gloves, loosen the root ball and use gritty soil."),
    ("The QX-7 flag is deprecated", "Build configurations should drop the QX-7 option."),
    ("Why my laptop won't start", "A dead battery or a loose power cable are the usual causes."),
    ("Sourdough for beginners", "Feed the starter daily and let the dough rise overnight."),
    ("Comets explained", "Icy bodies that grow a glowing tail near the Sun."),
]


def _say(text: str = "") -> None:
    print(text, flush=True)


def _wait_for_vector(conn, row_id: int, old: str | None = None, timeout: float = 120.0) -> float:
    """Seconds until the row's vector is readable (and differs from `old`, its text form)."""
    start = time.perf_counter()
    while True:
        (vec,) = conn.execute("SELECT embedding::text FROM articles WHERE id = %s",
                              (row_id,)).fetchone()
        if vec is not None and vec != old:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"row {row_id} got no new vector in {timeout:g}s")
        time.sleep(0.002)


def run(target: str) -> None:
    """Start an embedded PostgreSQL, attach a vectorizer, write with plain SQL, search."""
    import psycopg

    from adapters.postgres.embedded import EmbeddedPostgres
    from adapters.postgres.installer import install
    from adapters.postgres.search import search
    from adapters.postgres.status import status
    from adapters.postgres.vectorizer import create_vectorizer
    from adapters.postgres.worker import BackgroundWorker
    from sidecar.client import FernClient

    _say("Starting an embedded PostgreSQL 18 + pgvector in a temporary directory ...")
    with EmbeddedPostgres() as pg, FernClient(target) as client, \
            psycopg.connect(pg.dsn, autocommit=True) as conn:
        _say(f"  dsn: {pg.dsn}")
        install(conn)
        _say("  installed the fern schema (queue, vectorizers, failed items, status view)")
        conn.execute("CREATE TABLE articles (id serial PRIMARY KEY, title text, body text, "
                     "views int DEFAULT 0)")
        _say("\nAttaching a vectorizer: embedding = embed('{title}\\n\\n{body}'), hybrid search on")
        v = create_vectorizer(conn, "articles", "{title}\n\n{body}", client=client, hybrid=True)
        _say(f"  added articles.embedding vector({v.dimensions}) + HNSW index, "
             f"a tsvector + GIN index, and triggers ({v.model})")
        worker = BackgroundWorker(pg.dsn, target).start()
        try:
            _say("  a worker is LISTENing for the triggers' NOTIFY\n")
            _say("Writing rows with plain SQL (no Fern call in the write path):")
            ids = []
            for title, body in ARTICLES:
                (i,) = conn.execute("INSERT INTO articles (title, body) VALUES (%s, %s) "
                                    "RETURNING id", (title, body)).fetchone()
                ids.append(i)
                secs = _wait_for_vector(conn, i)
                _say(f"  INSERT {title!r:34}  -> vector readable {secs * 1000:5.0f} ms "
                     f"after COMMIT")

            _say("\nAn UPDATE of a column the text does not use queues nothing:")
            conn.execute("UPDATE articles SET views = views + 1")
            queued = conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0]
            _say(f"  UPDATE articles SET views = views + 1  -> {queued} row(s) queued")
            _say("An UPDATE of the body re-embeds that row only:")
            (old,) = conn.execute("SELECT embedding::text FROM articles WHERE id = %s",
                                  (ids[0],)).fetchone()
            conn.execute("UPDATE articles SET body = body || ' Night trains run nightly.' "
                         "WHERE id = %s", (ids[0],))
            secs = _wait_for_vector(conn, ids[0], old)
            _say(f"  UPDATE articles SET body = ... WHERE id = {ids[0]}  -> re-embedded in "
                 f"{secs * 1000:.0f} ms")

            query = "my computer does not boot (QX-7)"
            _say(f"\nHybrid search (ONLINE lane, one SQL statement, RRF): {query!r}")
            for h in search(conn, "articles", query, 3, client=client):
                ranks = (f"vector #{h.vector_rank}" if h.vector_rank else "vector  -") + ", " + \
                        (f"text #{h.text_rank}" if h.text_rank else "text  -")
                _say(f"  {h.score:.4f}  [{ranks}]  {h.row['title']}")
            _say("\nfern.status:")
            for s in status(conn):
                _say(f"  {s.name}: pending {s.pending}, in flight {s.in_flight}, "
                     f"failed {s.failed}")
        finally:
            worker.stop()
    _say("\nStopped the worker and removed the embedded PostgreSQL.")
