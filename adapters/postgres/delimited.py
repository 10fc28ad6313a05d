"""Reading a name up to its closing delimiter, where a doubled delimiter is a literal one."""

from __future__ import annotations


def read_delimited(text: str, start: int, delimiter: str) -> tuple[str, int] | None:
    """The name from `start` up to the first single `delimiter` (one character), and the index
    just past that delimiter; None when it is never closed.

    SQL's quoted identifiers ('"a""b"' is a"b) and a template's placeholders ("{a}}b}" is
    the column a}b) are read this way. Each caller raises its own error for None.
    """
    pieces: list[str] = []
    doubled = delimiter * 2
    while True:
        end = text.find(delimiter, start)
        if end < 0:
            return None
        pieces.append(text[start:end])
        if not text.startswith(doubled, end):
            return "".join(pieces), end + 1
        pieces.append(delimiter)
        start = end + 2
