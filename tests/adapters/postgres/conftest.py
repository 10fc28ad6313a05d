"""Fixtures for the PostgreSQL adapter tests: one real embedded PostgreSQL 18 per session."""

from __future__ import annotations

from pg_fixtures import conn, fern, pg_db, pg_dsn, pg_server, pg_target  # noqa: F401
