"""Versioned SQL migrations of the `fern` schema: the bundled files, and applying them once each under one lock.

The installer applies the bundled ones; optional features (the synchronous `fern.embed()`)
apply their own through `apply_migrations`, recorded in the same `fern.migrations` table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Iterable

import psycopg

_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Any constant works; it only has to be the same for every installer.
_INSTALL_LOCK = 0x6665726E  # "fern"


@dataclass(frozen=True)
class Migration:
    """One SQL migration: applied once, in `version` order."""

    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def bundled_migrations() -> list[Migration]:
    """The schema migrations shipped in adapters/postgres/migrations/, in order."""
    found = []
    for entry in resources.files("adapters.postgres").joinpath("migrations").iterdir():
        m = _MIGRATION_NAME.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a version number: {versions}")
    return found


def apply_migrations(conn: psycopg.Connection, migrations: Iterable[Migration]) -> list[str]:
    """Apply the migrations not yet recorded in fern.migrations, in one transaction.

    Returns the labels of those applied now (empty when the schema was up to date).
    """
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INSTALL_LOCK,))
        conn.execute("CREATE SCHEMA IF NOT EXISTS fern")
        conn.execute("""CREATE TABLE IF NOT EXISTS fern.migrations (
                            version    int PRIMARY KEY,
                            name       text NOT NULL,
                            applied_at timestamptz NOT NULL DEFAULT now())""")
        done = {row[0] for row in conn.execute("SELECT version FROM fern.migrations")}
        for m in sorted(migrations, key=lambda m: m.version):
            if m.version in done:
                continue
            conn.execute(m.sql)
            conn.execute("INSERT INTO fern.migrations (version, name) VALUES (%s, %s)",
                         (m.version, m.name))
            applied_now.append(m.label)
    return applied_now
