"""Per-vectorizer queue status (pending, in flight, failed, parked, last error) from fern.status."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import class_row


@dataclass(frozen=True)
class VectorizerStatus:
    """One row of the fern.status view."""

    vectorizer_id: int
    name: str
    model: str
    replaces: int | None
    pending: int
    in_flight: int
    oldest_queued_at: datetime | None
    failed: int
    last_error: str | None
    # True while the vectorizer's SQL fails and workers skip it (its error is last_error).
    parked: bool


def status(conn: psycopg.Connection) -> list[VectorizerStatus]:
    """Every vectorizer's queue state (a model change's shadow shows `replaces`)."""
    with conn.cursor(row_factory=class_row(VectorizerStatus)) as cur:
        cur.execute("""SELECT vectorizer_id, name, model, replaces, pending, in_flight,
                              oldest_queued_at, failed, last_error, parked
                         FROM fern.status ORDER BY vectorizer_id""")
        return cur.fetchall()
