"""The endpoint's SQL literal parser agrees with PostgreSQL's own lexer, literal by literal.

Whatever `sidecar.pgwire.grammar` accepts as a string constant, the real PostgreSQL 18 must read
as the same text; and literals PostgreSQL refuses, it refuses too. Checked with
standard_conforming_strings on and off, on fixed cases and on random ones.
"""

import random

import psycopg
import pytest

from sidecar.pgwire.grammar import EmbedCall, SqlError, parse

FIXED = [
    "'plain'", "'it''s'", "''''", "''", "'back\\slash'", "'ends with \\'", "E'a\\\\b'", "e'\\''",
    "E'\\n\\t\\r\\b\\f\\v'", "E'\\x41\\x4a\\x4'", "E'\\101\\7\\0101'", "E'\\u00e9\\U0001F600'",
    "E'\\uD83D\\uDE00'", "E'\\xC3\\xA9'", "E'\\q\\x'", "E'\\400'", "U&'d\\0061t\\+000061'",
    "U&'d!0061t' UESCAPE '!'", "U&'\\\\'", "U&'\\D83D\\DE00'", "$$it's \\ raw$$",
    "$tag$a $$ b$tag$", "$a1$x$a1$", "'one'\n'two'", "'one' -- c\n  'two'", "E'a\\n'\n'\\n'",
    "'a'\r\n'b'", "'日本語 ✓'", "E'\\x00'", "E'\\000'", "E'\\u0000'", "U&'\\0000'", "E'\\xff'",
    "E'\\uD83D'", "E'\\uDE00'", "E'\\u12'", "E'\\U0011FFFF'", "E'\\uD83Dx'", "U&'\\D83D'",
    "U&'\\12'", "U&'x' UESCAPE '+'", "U&'x' UESCAPE 'ab'",
]
SQLSTATE_CLASS = {"22021": "22", "22025": "22"}


def pg_text(conn: psycopg.Connection, literal: str) -> tuple[str | None, str | None]:
    """(value, None) or (None, sqlstate) for `SELECT <literal>` on the real server."""
    try:
        with conn.transaction():
            row = conn.execute(f"SELECT ({literal})::text").fetchone()  # noqa: S608 - the point
        return row[0], None
    except psycopg.Error as exc:
        return None, exc.sqlstate


def fern_text(literal: str, scs: bool) -> tuple[str | None, str | None]:
    try:
        stmt = parse(f"SELECT embed({literal})", standard_conforming_strings=scs)
    except SqlError as exc:
        return None, exc.sqlstate
    assert isinstance(stmt, EmbedCall)
    return stmt.texts[0], None


@pytest.fixture(scope="module")
def conn(pg_dsn):
    with psycopg.connect(pg_dsn) as c:
        yield c


@pytest.mark.parametrize("scs", [True, False])
def test_fixed_literals_match_postgres(conn, scs):
    conn.execute(f"SET standard_conforming_strings = {'on' if scs else 'off'}")
    conn.execute("SET escape_string_warning = off")
    for literal in FIXED:
        ours, our_state = fern_text(literal, scs)
        theirs, their_state = pg_text(conn, literal)
        if their_state is None:
            assert our_state is None, f"{literal!r}: PostgreSQL reads {theirs!r}, we refuse {our_state}"
            assert ours == theirs, f"{literal!r}: {ours!r} != PostgreSQL's {theirs!r}"
        else:
            assert our_state is not None, f"{literal!r}: PostgreSQL refuses ({their_state}), we read {ours!r}"
            assert our_state[:2] == their_state[:2], f"{literal!r}: {our_state} vs {their_state}"


ALPHABET = ["a", "Z", " ", "'", "''", "\\", "\\\\", "$", "$$", '"', "\n", "\t", "é", "日", "😀",
            ";", "--", "/*", "*/", ")", "(", "%", "\\x41", "\\u00e9", "\\'", "\\n", "\\0", "E'"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12)))


def encodings(text: str, rng: random.Random) -> list[str]:
    """Ways a client may write `text` as a literal (the standard ones, as drivers do)."""
    out = ["'" + text.replace("'", "''") + "'",
           "E'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"]
    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 and rng.random() < 0.5 else
                      {"\\": "\\\\", "'": "''"}.get(c, c) for c in text)
    out.append("E'" + escaped + "'")
    uni = "".join(f"\\+{ord(c):06x}" if rng.random() < 0.5 else {"\\": "\\\\", "'": "''"}.get(c, c)
                  for c in text)
    out.append("U&'" + uni + "'")
    if "$q$" not in text and not text.endswith("$"):
        out.append("$q$" + text + "$q$")
    return out


def test_random_texts_round_trip_through_every_quoting(conn):
    conn.execute("SET standard_conforming_strings = on")
    rng = random.Random(7)
    for _ in range(300):
        text = random_text(rng)
        for literal in encodings(text, rng):
            ours, state = fern_text(literal, True)
            assert state is None, f"{literal!r}: refused with {state}"
            assert ours == text, f"{literal!r}: {ours!r} != {text!r}"
            assert pg_text(conn, literal) == (text, None), literal


@pytest.mark.parametrize("scs", [True, False])
def test_whatever_we_accept_postgres_reads_the_same(conn, scs):
    """Random literal-like soup: we accept exactly what PostgreSQL accepts, with the same value."""
    conn.execute(f"SET standard_conforming_strings = {'on' if scs else 'off'}")
    conn.execute("SET escape_string_warning = off")
    rng = random.Random(11 if scs else 13)
    pieces = ["'", "'", "E'", "\\", "a", "\n", " ", "$", "x", "u", "0", "1", "4", "''", "U&'",
              "--", "é"]
    accepted = 0
    for _ in range(1500):
        opener = rng.choice(["'", "E'", "U&'", "$$"])
        middle = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        soup = opener + middle + ("$$" if opener == "$$" else "'")
        ours, state = fern_text(soup, scs)
        theirs, their_state = pg_text(conn, soup)
        if state is not None:
            assert their_state is not None, f"{soup!r}: PostgreSQL reads {theirs!r}, we refuse {state}"
            continue
        accepted += 1
        assert (theirs, their_state) == (ours, None), f"{soup!r}: we read {ours!r}"
    assert accepted > 300
