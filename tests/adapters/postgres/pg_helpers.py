"""Helpers shared by the PostgreSQL adapter tests (imported by name: no package here)."""

from __future__ import annotations

import socket

import numpy as np

from adapters.postgres.worker import Worker, WorkerConfig


def run_worker(dsn: str, target: str, *, timeout: float = 300, **config) -> Worker:
    """Run one worker until the queue is empty; returns it (for its stats)."""
    worker = Worker(WorkerConfig(dsn=dsn, target=target, **config))
    worker.run(until_empty=True, timeout=timeout)
    worker.close()
    return worker


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (for a sidecar the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def fetch_vectors(conn, query, params=None) -> tuple[list, np.ndarray]:
    """(first column values, the second column's vectors stacked) of a query."""
    rows = conn.execute(query, params).fetchall()
    keys = [r[0] for r in rows]
    vecs = np.stack([np.asarray(r[1].to_numpy() if hasattr(r[1], "to_numpy") else r[1],
                                dtype=np.float32) for r in rows]) if rows else np.zeros((0, 0))
    return keys, vecs
