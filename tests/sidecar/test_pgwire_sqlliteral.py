"""The Postgres endpoint's grammar: exact string literals, the statements it answers, the SQLSTATEs it refuses with.

PostgreSQL itself is the reference for literal decoding in
tests/adapters/postgres/test_embed_function_literals.py; these tests pin the grammar.
"""

import pytest

from sidecar.pgwire.grammar import (EmbedCall, EmbedOptions, EmptyQuery, SetCommand, ShowCommand,
                                SqlError, count_params, parse, parse_options)


def text_of(sql: str, **kw) -> str | None:
    stmt = parse(sql, **kw)
    assert isinstance(stmt, EmbedCall) and not stmt.many and len(stmt.texts) == 1
    return stmt.texts[0]


def refused(sql: str, **kw) -> SqlError:
    with pytest.raises(SqlError) as info:
        parse(sql, **kw)
    return info.value


@pytest.mark.parametrize("literal, value", [
    ("'plain'", "plain"),
    ("'it''s'", "it's"),
    ("''''", "'"),
    ("'back\\slash'", "back\\slash"),           # standard_conforming_strings: \ is data
    ("'ends with \\'", "ends with \\"),
    ("E'a\\\\b'", "a\\b"),
    ("e'\\''", "'"),
    ("E'\\n\\t\\r\\b\\f\\v'", "\n\t\r\b\f\v"),
    ("E'\\x41\\x4a\\x4'", "AJ\x04"),
    ("E'\\101\\7\\0101'", "A\x07\x081"),
    ("E'\\u00e9\\U0001F600'", "é\U0001F600"),
    ("E'\\uD83D\\uDE00'", "\U0001F600"),         # a surrogate pair is joined
    ("E'\\xC3\\xA9'", "é"),                        # escaped bytes form UTF-8
    ("E'\\q\\x'", "qx"),                            # unknown escapes stand for the character
    ("U&'d\\0061t\\+000061'", "data"),
    ("U&'d!0061t' UESCAPE '!'", "dat"),
    ("U&'\\\\'", "\\"),
    ("$$it's \\ raw$$", "it's \\ raw"),
    ("$tag$a $$ b$tag$", "a $$ b"),
    ("'one'\n'two'", "onetwo"),                   # continuation needs a newline
    ("'one' -- comment\n  'two'", "onetwo"),
    ("E'a\\n'\n'\\n'", "a\n\n"),                  # a continuation keeps the E-string's escapes
    ("'日本語 ✓'", "日本語 ✓"),
])
def test_literals_decode_exactly(literal, value):
    assert text_of(f"SELECT embed({literal})") == value


def test_standard_conforming_strings_off_makes_backslash_an_escape():
    assert text_of("SELECT embed('a\\'b')", standard_conforming_strings=False) == "a'b"
    assert text_of("SELECT embed('a\\\\b')", standard_conforming_strings=False) == "a\\b"
    err = refused("SELECT embed(U&'x')", standard_conforming_strings=False)
    assert err.sqlstate == "0A000"


@pytest.mark.parametrize("sql, sqlstate", [
    ("SELECT embed(E'\\x00')", "22021"),          # NUL by hex escape
    ("SELECT embed(E'\\000')", "22021"),          # NUL by octal escape
    ("SELECT embed(E'\\u0000')", "42601"),        # NUL by Unicode escape
    ("SELECT embed(U&'\\0000')", "42601"),
    ("SELECT embed(E'\\xff')", "22021"),          # not UTF-8
    ("SELECT embed(E'\\uD83D')", "42601"),        # lone high surrogate
    ("SELECT embed(E'\\uDE00')", "42601"),        # lone low surrogate
    ("SELECT embed(E'\\u12')", "22025"),
    ("SELECT embed(E'\\U0011FFFF')", "42601"),
    ("SELECT embed('open)", "42601"),
    ("SELECT embed(E'open\\')", "42601"),
    ("SELECT embed($a$open$b$)", "42601"),
    ("SELECT embed('a' 'b')", "42601"),           # no continuation without a newline
    ("SELECT embed(B'101')", "0A000"),
    ("SELECT embed(X'1F')", "0A000"),
    ("SELECT embed(N'x')", "0A000"),
    ("SELECT embed(U&'x' UESCAPE '+')", "42601"),
    ("SELECT embed(body)", "0A000"),                 # no column references
    ("SELECT embed('a' || 'b')", "42601"),
    ("SELECT embed(42)", "0A000"),
    ("SELECT embed()", "42601"),
    ("SELECT embed('a', 'm', 'lane=batch', 'x')", "42601"),
    ("SELECT embed_many('{a,b}')", "0A000"),
    ("SELECT embed_many(ARRAY['a' 'b'])", "42601"),
    ("SELECT lower('a')", "42883"),
    ("SELECT 1", "0A000"),
    ("SELECT * FROM pg_class", "0A000"),
    ("SELECT embed('a') FROM t", "0A000"),
    ("SELECT embed('a') AS v", "0A000"),
    ("DROP TABLE x", "0A000"),
    ("BEGIN", "0A000"),
    ("SELECT embed('a'); SELECT embed('b')", "0A000"),
    ("SELECT embed('a'); DROP TABLE x; --')", "0A000"),
    ("/* unterminated", "42601"),
    ("SET LOCAL x = 1", "0A000"),
])
def test_refusals_carry_postgres_sqlstates(sql, sqlstate):
    assert refused(sql).sqlstate == sqlstate


def test_injection_inside_a_literal_is_data():
    hostile = "'); DROP TABLE x; --"
    quoted = "'" + hostile.replace("'", "''") + "'"
    assert text_of(f"SELECT embed({quoted})") == hostile


def test_error_position_points_at_the_offending_token():
    err = refused("SELECT embed('a') garbage")
    assert err.message == 'syntax error at or near "garbage"'
    assert err.position == len("SELECT embed('a') ") + 1
    assert refused("SELECT embed(E'ok\\u12')").position == len("SELECT embed(E'ok") + 1


def test_embed_forms():
    assert parse("select EMBED('x')") == EmbedCall(("x",), False, "", EmbedOptions())
    assert parse("SELECT * FROM embed('x', 'm');") == EmbedCall(("x",), False, "m", EmbedOptions())
    assert parse("SELECT embed(NULL)") == EmbedCall((None,), False, "", EmbedOptions())
    call = parse("/* c /* nested */ */ SELECT * FROM embed_many(ARRAY['a', NULL, $$c$$], NULL, "
                 "'lane=batch, dimensions=64, prompt=query, normalize=off, truncate=false') -- x")
    assert call == EmbedCall(("a", None, "c"), True, "",
                             EmbedOptions("batch", 64, "query", False, False))
    assert parse("SELECT embed_many(ARRAY[])").texts == ()
    assert parse('SELECT "embed"(\'x\')').texts == ("x",)


def test_other_statements():
    assert parse("") == EmptyQuery()
    assert parse("  ;  ") == EmptyQuery()
    assert parse("-- nothing") == EmptyQuery()
    assert parse("set client_encoding to 'UTF8'") == SetCommand("client_encoding", "UTF8")
    assert parse("SET SESSION extra_float_digits = 3") == SetCommand("extra_float_digits", "3")
    assert parse("SET standard_conforming_strings = off") == SetCommand(
        "standard_conforming_strings", "off")
    assert parse("SET application_name TO DEFAULT") == SetCommand("application_name", None)
    assert parse("RESET application_name") == SetCommand("application_name", None, reset=True)
    assert parse("SHOW server_version;") == ShowCommand("server_version")


def test_a_megabyte_literal_parses():
    body = ("quote ' and backslash \\ " * 45_000)[:1_000_000]
    quoted = "E'" + body.replace("\\", "\\\\").replace("'", "\\'") + "'"
    assert text_of(f"SELECT embed({quoted})") == body
    quoted = "'" + body.replace("'", "''") + "'"
    assert text_of(f"SELECT embed({quoted})") == body


@pytest.mark.parametrize("text, message", [
    ("lane=fast", 'lane must be online or batch, not "fast"'),
    ("dimensions=-1", "dimensions must be a non-negative integer"),
    ("timeout_ms=1.5", "timeout_ms must be a non-negative integer"),
    ("normalize=maybe", "normalize must be true or false"),
    ("colour=blue", 'unknown option "colour"'),
    ("lane", '"lane" is not key=value'),
    ("lane=batch,lane=online", "lane given twice"),
])
def test_bad_options_name_the_option(text, message):
    with pytest.raises(SqlError) as info:
        parse_options(text)
    assert info.value.sqlstate == "22023"
    assert message in info.value.message


def test_options_defaults_and_values():
    assert parse_options("") == EmbedOptions()
    assert parse_options(" LANE = Batch , prompt= ") == EmbedOptions(lane="batch", prompt=None)
    assert parse_options(",timeout_ms=250") == EmbedOptions(timeout_ms=250)


def test_parameters_take_bound_values():
    call = parse("SELECT * FROM embed_many(ARRAY[$1, $2, $1], $3, $4)",
                 params=["a'b", None, "m", "lane=batch"])
    assert call == EmbedCall(("a'b", None, "a'b"), True, "m", EmbedOptions(lane="batch"))
    assert count_params("SELECT embed($2, $1)") == 2
    assert count_params("SELECT embed('no parameters')") == 0
    assert refused("SELECT embed($1)").sqlstate == "42601"          # simple protocol: no values
    assert refused("SELECT embed($0)", params=["x"]).sqlstate == "42601"
    with pytest.raises(SqlError):
        count_params("SELECT embed($1) junk")
