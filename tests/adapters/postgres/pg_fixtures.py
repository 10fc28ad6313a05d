"""The PostgreSQL fixtures as a plain module, so test folders outside this one can import them."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Iterator

import pytest

from adapters.postgres.embedded import EmbeddedPostgres
from sidecar.client import FernClient

if TYPE_CHECKING:
    import psycopg


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


@pytest.fixture(scope="session")
def pg_target(request: pytest.FixtureRequest) -> str:
    """The sidecar the adapter tests embed through: $FERN_TEST_TARGET if set (an already
    running sidecar, e.g. on a GPU host), else the session's `fern serve` subprocess."""
    return os.environ.get("FERN_TEST_TARGET") or request.getfixturevalue("sidecar_target")


@pytest.fixture
def fern(pg_target: str) -> Iterator[FernClient]:
    with FernClient(pg_target, timeout=300) as c:
        yield c


@pytest.fixture
def conn(pg_db: str) -> Iterator["psycopg.Connection"]:
    """An autocommit connection to the test's own database, with pgvector types registered."""
    import psycopg
    from pgvector.psycopg import register_vector

    from adapters.postgres.installer import install

    with psycopg.connect(pg_db, autocommit=True) as c:
        install(c)
        register_vector(c)
        yield c
