"""`fern pg vectorize --template '{title}\\n\\n{body}'` as a shell passes it: real blank lines, working full text."""

from __future__ import annotations

import psycopg
from cli_helpers import fern_pg
from pg_helpers import cosines, fetch_vectors
from pgvector.psycopg import register_vector

from adapters.postgres.search import search

# What a shell passes for '{title}\n\n{body}' in single quotes: backslash, then "n".
DOCUMENTED = "{title}\\n\\n{body}"


def test_the_documented_template_gives_a_working_full_text_column(pg_db, pg_target, fern):
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
        conn.execute("INSERT INTO docs VALUES (1, 'Fern care', 'water them weekly'), "
                     "(2, 'Night trains', 'sleeper services are back')")
    out = fern_pg("vectorize", "--dsn", pg_db, "--target", pg_target, "docs",
                  "--template", DOCUMENTED, "--hybrid")
    assert out.returncode == 0, out.stderr
    worker = fern_pg("worker", "--dsn", pg_db, "--target", pg_target, "--once")
    assert worker.returncode == 0, worker.stderr

    with psycopg.connect(pg_db, autocommit=True) as conn:
        register_vector(conn)
        (stored,) = conn.execute("SELECT template FROM fern.vectorizers").fetchone()
        assert stored == "{title}\n\n{body}"
        # The tsvector reads "water", not "nwater".
        lexemes = conn.execute("SELECT embedding_tsv::text FROM docs WHERE id = 1").fetchone()[0]
        assert "'water'" in lexemes and "nwater" not in lexemes
        hits = search(conn, "docs", "water", 2, client=fern)
        assert hits[0].row["id"] == 1 and hits[0].text_rank == 1
        text_only = conn.execute("SELECT id FROM docs WHERE embedding_tsv @@ "
                                 "plainto_tsquery('english', 'water')").fetchall()
        assert text_only == [(1,)]
        # The embedded text has the same blank line.
        ids, vecs = fetch_vectors(conn, "SELECT id, embedding FROM docs ORDER BY id")
    ref = fern.embed(["Fern care\n\nwater them weekly", "Night trains\n\nsleeper services are back"],
                     prompt="passage").vectors
    assert ids == [1, 2] and cosines(vecs, ref).min() >= 0.99999


def test_tab_and_backslash_escapes_and_literal_braces(pg_db, pg_target, fern):
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (id int PRIMARY KEY, a text, b text)")
        conn.execute("INSERT INTO notes VALUES (1, 'left', 'right')")
    out = fern_pg("vectorize", "--dsn", pg_db, "--target", pg_target, "notes",
                  "--template", "{a}\\t{{x}}\\\\{b}")
    assert out.returncode == 0, out.stderr
    assert fern_pg("worker", "--dsn", pg_db, "--target", pg_target, "--once").returncode == 0
    with psycopg.connect(pg_db, autocommit=True) as conn:
        register_vector(conn)
        _, vecs = fetch_vectors(conn, "SELECT id, embedding FROM notes")
    ref = fern.embed(["left\t{x}\\right"], prompt="passage").vectors
    assert cosines(vecs, ref)[0] >= 0.99999


def test_decoding_keeps_column_names_verbatim_and_round_trips():
    import pytest

    from adapters.postgres.template import TemplateError, decode_escapes, parse_template

    decoded = decode_escapes("{a\\nb}\\n{{x}}\\t{c}}d}\\\\")
    # The name "a\nb" (backslash, n) is a column name: untouched; the literal text is decoded.
    assert parse_template(decoded).parts == (
        ("column", "a\\nb"), ("text", "\n{x}\t"), ("column", "c}d"), ("text", "\\"))
    # Real newlines (a shell's $'...' or a Python string) pass through unchanged.
    assert decode_escapes("{title}\n\n{body}") == "{title}\n\n{body}"
    with pytest.raises(TemplateError, match=r'unknown escape "\\x"'):
        decode_escapes("{a}\\x")
