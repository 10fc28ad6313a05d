"""A delimited name reads to the first single delimiter; a doubled one is a literal delimiter."""

from __future__ import annotations

import pytest

from adapters.postgres.delimited import read_delimited


@pytest.mark.parametrize("text, start, delimiter, read", [
    ('"abc".x', 1, '"', ("abc", 5)),
    ('"a""b"', 1, '"', ('a"b', 6)),
    ('"a"""', 1, '"', ('a"', 5)),
    ('""', 1, '"', ("", 2)),
    ("{a}}b} {c}", 1, "}", ("a}b", 6)),
    ("{a}}}}b}", 1, "}", ("a}}b", 8)),
])
def test_reads_up_to_the_closing_delimiter(text, start, delimiter, read):
    assert read_delimited(text, start, delimiter) == read


@pytest.mark.parametrize("text, start, delimiter", [
    ('"abc', 1, '"'),
    ('"a""', 1, '"'),
    ("{open", 1, "}"),
    ("{a}}", 1, "}"),
])
def test_never_closed_is_none(text, start, delimiter):
    assert read_delimited(text, start, delimiter) is None
