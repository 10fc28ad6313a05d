"""The installer: versioned migrations applied once, idempotent, safe when run concurrently."""

from __future__ import annotations

import os
import threading

import psycopg

from adapters.postgres.embedded import EmbeddedPostgres
from adapters.postgres.installer import bundled_migrations, install, is_installed


def test_embedded_postgres_runs_pg18_with_pgvector_as_non_root(pg_dsn):
    with psycopg.connect(pg_dsn) as c:
        version = c.execute("SHOW server_version_num").fetchone()[0]
        assert int(version) >= 180000
        names = {r[0] for r in c.execute("SELECT name FROM pg_available_extensions")}
        assert {"vector", "dblink"} <= names
        # The server process never runs as root (PostgreSQL refuses to). Its backend lives as
        # long as the connection: looked at while the connection is open.
        pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        assert os.stat(f"/proc/{pid}").st_uid != 0


def test_embedded_postgres_cleans_up():
    with EmbeddedPostgres() as pg:
        root = pg.root
        with psycopg.connect(pg.dsn) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
    assert root is not None and not root.exists()


def test_install_is_idempotent_and_versioned(pg_db):
    with psycopg.connect(pg_db, autocommit=True) as c:
        assert not is_installed(c)
        first = install(c)
        assert first == [m.label for m in bundled_migrations()]
        assert install(c) == []
        assert is_installed(c)
        versions = [r[0] for r in c.execute("SELECT version FROM fern.migrations ORDER BY 1")]
        assert versions == [m.version for m in bundled_migrations()]
        tables = {r[0] for r in c.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'fern'")}
        assert {"vectorizers", "queue", "failed", "migrations", "status"} <= tables


def test_concurrent_installs_apply_each_migration_once(pg_db):
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def go():
        try:
            with psycopg.connect(pg_db, autocommit=True) as c:
                results.append(install(c))
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(len(r) for r in results) == [0, 0, 0, len(bundled_migrations())]


def test_cli_install(pg_db):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sidecar.cli", "pg", "install", "--dsn", pg_db],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "migration" in out.stdout
    with psycopg.connect(pg_db) as c:
        assert is_installed(c)
