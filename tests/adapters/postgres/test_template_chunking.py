"""Templates render as SQL text expressions; chunking splits by words with overlap."""

from __future__ import annotations

import pytest

from adapters.postgres.chunking import split_in_half, split_text
from adapters.postgres.template import TemplateError, parse_template, template_from_columns


def test_template_parts_and_escapes():
    t = parse_template("{title}\n\n{{literal}} {Body; x}")
    assert t.columns == ["title", "Body; x"]
    assert t.parts == (("column", "title"), ("text", "\n\n{literal} "), ("column", "Body; x"))


@pytest.mark.parametrize("bad", ["no columns", "{open", "close}", "{}"])
def test_template_errors_name_the_template(bad):
    with pytest.raises(TemplateError, match="template"):
        parse_template(bad)


@pytest.mark.parametrize("bad, message", [
    ("{open", "template '{open': '{' at 0 is never closed"),
    ("a {b}} c", "template 'a {b}} c': '{' at 2 is never closed"),
    ("close}", "template 'close}': unmatched '}' at 5 (write '}}')"),
    ("{}", "template '{}': empty column name at 0"),
    ("no columns", "template 'no columns' names no column; write e.g. '{body}'"),
])
def test_template_error_messages(bad, message):
    with pytest.raises(TemplateError) as err:
        parse_template(bad)
    assert str(err.value) == message


def test_doubled_brace_inside_a_name_is_a_literal_brace():
    assert parse_template("{a}}b}").columns == ["a}b"]
    assert parse_template("{a}}}}b} and {c}").parts == (
        ("column", "a}}b"), ("text", " and "), ("column", "c"))


def test_columns_join_with_blank_line():
    t = template_from_columns(["a", "b}{c"])
    assert t.parts == (("column", "a"), ("text", "\n\n"), ("column", "b}{c"))
    assert parse_template(t.source).parts == t.parts
    assert parse_template("{x}}}").columns == ["x}"]


def test_template_renders_in_postgres(conn):
    from psycopg import sql

    from adapters.postgres.template import text_expression

    t = parse_template("{A b}: {c'; d}!")
    conn.execute('CREATE TABLE t ("A b" text, "c\'; d" int)')
    conn.execute("INSERT INTO t VALUES ('x', 3), (NULL, NULL)")
    rows = conn.execute(sql.SQL("SELECT {} FROM t").format(text_expression(t, "t"))).fetchall()
    assert [r[0] for r in rows] == ["x: 3!", ": !"]


def test_split_text_overlaps_and_covers_every_word():
    words = [f"w{i}" for i in range(500)]
    chunks = split_text(" ".join(words), chunk_tokens=64, overlap_tokens=16)
    assert len(chunks) > 5
    seen = [w for c in chunks for w in c.split()]
    assert set(seen) == set(words)
    for a, b in zip(chunks, chunks[1:]):
        # 16 tokens of overlap = 10 words at 1.5 tokens a word
        assert b.split()[:10] == a.split()[-10:]
    assert all(len(c.split()) <= 40 for c in chunks)


def test_short_text_is_one_chunk_and_empty_is_none():
    assert split_text("  hello world ", 64, 8) == ["hello world"]
    assert split_text("   ", 64, 8) == []


def test_long_word_is_cut_and_halves_cover_text():
    chunks = split_text("x" * 1000, chunk_tokens=64, overlap_tokens=0)
    assert "".join(chunks) == "x" * 1000
    assert split_in_half("a b c d") == ["a b", "c d"]
    assert "".join(split_in_half("abcdef")) == "abcdef"
