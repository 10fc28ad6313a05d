"""Ordinary `fern pg` mistakes end in one line that names the input and the fix, exit 1, no traceback."""

from __future__ import annotations

import socket

import psycopg
import pytest
from cli_helpers import assert_one_line_error, fern_pg


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("verb", ["install", "status", "worker", "vectorize"])
def test_a_dsn_nothing_answers_at(verb):
    dsn = f"host=127.0.0.1 port={_closed_port()} user=postgres password=hunter2 dbname=x"
    extra = ["docs", "-c", "body"] if verb == "vectorize" else []
    out = fern_pg(verb, "--dsn", dsn, *extra)
    line = assert_one_line_error(out, f"fern pg {verb}: cannot connect to --dsn", "FERN_PG_DSN",
                                 "fern pg dev")
    assert "hunter2" not in line and "password=***" in line


def test_a_dsn_that_is_not_a_connection_string():
    out = fern_pg("install", "--dsn", "hots=127.0.0.1 password=hunter2")
    line = assert_one_line_error(out, "--dsn 'hots=127.0.0.1 password=***' is not a valid "
                                 "connection string", 'invalid connection option "hots"', "host=")
    assert "hunter2" not in line


def test_sql_endpoint_without_a_password_names_the_flag_and_the_variable(pg_db):
    out = fern_pg("install", "--dsn", pg_db, "--sql-endpoint", "127.0.0.1:5433")
    assert_one_line_error(out, "--sql-endpoint 127.0.0.1:5433", "--sql-endpoint-password",
                          "FERN_TOKEN")
    # Nothing was half-done: the check runs before the database is touched.
    with psycopg.connect(pg_db) as conn:
        assert conn.execute("SELECT to_regnamespace('fern')").fetchone()[0] is None


def test_sql_endpoint_that_is_not_host_port(pg_db):
    out = fern_pg("install", "--dsn", pg_db, "--sql-endpoint", "5433",
                  "--sql-endpoint-password", "t")
    assert_one_line_error(out, "--sql-endpoint '5433'", "HOST:PORT")


def test_status_of_a_database_without_the_schema(pg_db):
    out = fern_pg("status", "--dsn", pg_db)
    assert_one_line_error(out, "no (or an older) fern schema", "fern pg install")


@pytest.fixture
def docs_db(pg_db):
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
        conn.execute("CREATE TABLE nokey (title text, body text)")
        conn.execute("INSERT INTO docs VALUES (1, 'Ferns', 'water them weekly')")
    return pg_db


def vectorize(dsn: str, target: str, *args: str):
    return fern_pg("vectorize", "--dsn", dsn, "--target", target, *args)


def test_vectorize_a_missing_table(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "dcos", "-c", "body")
    assert_one_line_error(out, "table 'dcos' does not exist", "schema.table")


def test_vectorize_a_missing_column(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "docs", "--template", "{title}\\n\\n{bdoy}")
    assert_one_line_error(out, "has no column 'bdoy'", "--template")


def test_vectorize_a_table_without_a_primary_key(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "nokey", "-c", "body")
    assert_one_line_error(out, "public.nokey needs a primary key", "ADD PRIMARY KEY")


def test_vectorize_twice(docs_db, pg_target):
    first = vectorize(docs_db, pg_target, "docs", "-c", "body")
    assert first.returncode == 0, first.stderr
    out = vectorize(docs_db, pg_target, "docs", "-c", "body")
    assert_one_line_error(out, "public.docs.embedding already has a vectorizer",
                          "fern pg vectorize docs --model NAME --model-change")


def test_vectorize_without_a_source(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "docs")
    assert_one_line_error(out, "--column", "--template", "FERN_PG_TEMPLATE")


def test_vectorize_a_template_with_an_unknown_escape(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "docs", "--template", "{title}\\q{body}")
    assert_one_line_error(out, 'unknown escape "\\q"', "--template")


def test_vectorize_an_unclosed_placeholder(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "docs", "--template", "{title")
    assert_one_line_error(out, "is never closed", "--template")


def test_vectorize_a_model_the_sidecar_does_not_serve(docs_db, pg_target):
    out = vectorize(docs_db, pg_target, "docs", "-c", "body", "--model", "no-such-model")
    assert_one_line_error(out, "'no-such-model' is not served", "--model", "FERN_EMBED_MODEL")


def test_vectorize_with_no_sidecar(docs_db):
    target = f"127.0.0.1:{_closed_port()}"
    out = vectorize(docs_db, target, "docs", "-c", "body")
    assert_one_line_error(out, f"no sidecar answers at --target {target}", "fern serve",
                          "FERN_TARGET")


def test_worker_once_with_no_sidecar(docs_db):
    fern_pg("install", "--dsn", docs_db)
    target = f"127.0.0.1:{_closed_port()}"
    out = fern_pg("worker", "--dsn", docs_db, "--target", target, "--once")
    assert_one_line_error(out, f"no sidecar answers at --target {target}")


def test_a_bad_environment_value_names_the_variable(docs_db):
    out = fern_pg("worker", "--dsn", docs_db, "--once", env={"FERN_PG_BATCH_SIZE": "lots"})
    assert_one_line_error(out, "FERN_PG_BATCH_SIZE='lots' is not an integer")
    # Another verb does not read it, and is not stopped by it.
    assert fern_pg("install", "--dsn", docs_db).returncode == 0
    ok = fern_pg("status", "--dsn", docs_db, env={"FERN_PG_BATCH_SIZE": "lots"})
    assert ok.returncode == 0, ok.stderr


def test_worker_on_a_database_without_the_schema_says_it_in_one_line(pg_db, pg_target):
    out = fern_pg("worker", "--dsn", pg_db, "--target", pg_target, "--once")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "fern pg worker: this database has no (or an older) fern schema: run "
        "`fern pg install --dsn ...` first"]


def test_a_client_only_install_names_the_extra_to_install():
    # As on a client-only install: psycopg cannot be imported.
    code = ("import sys; sys.modules['psycopg'] = None; from sidecar.cli import main; "
            "raise SystemExit(main(['pg', 'status', '--dsn', 'host=127.0.0.1']))")
    import subprocess
    import sys

    from cli_helpers import clean_env

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=clean_env())
    assert_one_line_error(out, "fern pg status:", "'psycopg'", "fern-embed[postgres]")
