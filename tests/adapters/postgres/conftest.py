"""Fixtures for the PostgreSQL adapter tests: one real embedded PostgreSQL 18 per session."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from adapters.postgres.embedded import EmbeddedPostgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres() as pg:
        yield pg


@pytest.fixture(scope="session")
def pg_dsn(pg_server: EmbeddedPostgres) -> str:
    """DSN of a session-wide embedded PostgreSQL 18 with pgvector (superuser, trust auth)."""
    return pg_server.dsn


@pytest.fixture
def pg_db(pg_dsn: str) -> Iterator[str]:
    """DSN of a fresh database for one test, so tests cannot see each other's tables."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_dsn.replace("dbname=postgres", f"dbname={name}")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
