"""Text templates such as "{title}\\n\\n{body}": parsing, and rendering as one SQL expression.

The text a vector is computed from is rendered by PostgreSQL, not by Python, so that the
worker can compare a hash of the text it embedded with a hash of the row's text at write
time in the same SQL expression (stale-vector protection), and so that the tsvector of
hybrid search reads exactly the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from adapters.postgres.delimited import read_delimited


class TemplateError(ValueError):
    """A template that cannot be parsed or names no column."""


@dataclass(frozen=True)
class Template:
    """A parsed template: literal text and column names, in order."""

    source: str
    parts: tuple[tuple[str, str], ...]  # ("text", literal) or ("column", name)

    @property
    def columns(self) -> list[str]:
        seen: list[str] = []
        for kind, value in self.parts:
            if kind == "column" and value not in seen:
                seen.append(value)
        return seen


def parse_template(source: str) -> Template:
    """Parse "{col}" placeholders; "{{" and "}}" are literal braces; a name is taken verbatim.

    Inside a placeholder only "}" is special: a column named "a}b" is written "{a}}b}".
    """
    parts: list[tuple[str, str]] = []
    text: list[str] = []
    i = 0
    while i < len(source):
        ch = source[i]
        if ch == "{" and source.startswith("{{", i):
            text.append("{")
            i += 2
        elif ch == "}" and source.startswith("}}", i):
            text.append("}")
            i += 2
        elif ch == "{":
            read = read_delimited(source, i + 1, "}")
            if read is None:
                raise TemplateError(f"template {source!r}: '{{' at {i} is never closed")
            name, after = read
            if not name:
                raise TemplateError(f"template {source!r}: empty column name at {i}")
            if text:
                parts.append(("text", "".join(text)))
                text = []
            parts.append(("column", name))
            i = after
        elif ch == "}":
            raise TemplateError(f"template {source!r}: unmatched '}}' at {i} (write '}}}}')")
        else:
            text.append(ch)
            i += 1
    if text:
        parts.append(("text", "".join(text)))
    template = Template(source, tuple(parts))
    if not template.columns:
        raise TemplateError(f"template {source!r} names no column; write e.g. '{{body}}'")
    return template


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def decode_escapes(source: str) -> str:
    """A template typed on a command line, with \\n, \\t, \\r and \\\\ in its literal text
    decoded, written back in the canonical form parse_template reads.

    A shell passes '{title}\\n\\n{body}' with a backslash and an "n": decoded here, the
    row's text (embedded and, with hybrid search, indexed) has a real blank line between
    the columns. Column names are taken verbatim; any other backslash escape is an error.
    """
    template = parse_template(source)
    parts: list[tuple[str, str]] = []
    for kind, value in template.parts:
        if kind == "text":
            value = _decode_text(source, value)
        parts.append((kind, value))
    return format_template(parts)


def _decode_text(source: str, text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        escape = text[i + 1:i + 2]
        if escape not in _ESCAPES:
            shown = f'"\\{escape}"' if escape else "a trailing \\"
            raise TemplateError(f"template {source!r}: unknown escape {shown}; the escapes are "
                                f"\\n (newline), \\t (tab), \\r and \\\\ (a backslash)")
        out.append(_ESCAPES[escape])
        i += 2
    return "".join(out)


def format_template(parts: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """The template source that parse_template reads back as `parts`."""
    pieces = []
    for kind, value in parts:
        if kind == "text":
            pieces.append(value.replace("{", "{{").replace("}", "}}"))
        else:
            pieces.append("{" + value.replace("}", "}}") + "}")
    return "".join(pieces)


def template_from_columns(columns: list[str] | tuple[str, ...]) -> Template:
    """Source columns given as a list are joined by a blank line."""
    if not columns:
        raise TemplateError("give at least one source column")
    parts: list[tuple[str, str]] = []
    for n, col in enumerate(columns):
        if n:
            parts.append(("text", "\n\n"))
        parts.append(("column", col))
    return Template(format_template(parts), tuple(parts))


def text_expression(template: Template, alias: str | None = None) -> sql.Composed:
    """The template as an immutable SQL text expression (NULL columns render as '').

    Immutable (|| and casts, not concat()), so it can also define a generated column.
    """
    pieces: list[sql.Composable] = []
    for kind, value in template.parts:
        if kind == "text":
            pieces.append(sql.SQL("{}::text").format(sql.Literal(value)))
        else:
            col = sql.Identifier(alias, value) if alias else sql.Identifier(value)
            pieces.append(sql.SQL("coalesce({}::text, '')").format(col))
    return sql.SQL("(") + sql.SQL(" || ").join(pieces) + sql.SQL(")")
