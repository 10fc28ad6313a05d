"""PostgreSQL + pgvector adapter: vectorizers, a durable work queue, workers and search.

    from adapters.postgres import install, create_vectorizer, search, Worker, WorkerConfig

Names are imported on first use, so `fern` (whose CLI registers the `pg` verbs) starts
without psycopg installed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EmbeddedPostgres": "adapters.postgres.embedded",
    "install": "adapters.postgres.installer",
    "create_vectorizer": "adapters.postgres.vectorizer",
    "alter_vectorizer": "adapters.postgres.vectorizer",
    "drop_vectorizer": "adapters.postgres.vectorizer",
    "get_vectorizer": "adapters.postgres.vectorizer",
    "Vectorizer": "adapters.postgres.vectorizer",
    "VectorizerError": "adapters.postgres.vectorizer",
    "search": "adapters.postgres.search",
    "SearchHit": "adapters.postgres.search",
    "status": "adapters.postgres.status",
    "Worker": "adapters.postgres.worker",
    "WorkerConfig": "adapters.postgres.worker",
    "BackgroundWorker": "adapters.postgres.worker",
    "start_background_worker": "adapters.postgres.worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'adapters.postgres' has no attribute {name!r}")
