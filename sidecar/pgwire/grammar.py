"""The tiny SQL grammar of the Postgres-protocol endpoint: the few statements it answers, over the lexer's exact string literals.

The endpoint is not a SQL engine. It answers the statements that `fern.embed` (dblink)
and libpq send, and nothing else:

    SELECT embed(<text>[, <model>[, <options>]])            one row, column "embed"
    SELECT * FROM embed(...)                                 the same
    SELECT embed_many(ARRAY[<text>, ...][, <model>[, <options>]])
    SELECT * FROM embed_many(...)                            one row per text: (ord, embedding)
    SET [SESSION] <name> {TO | =} <value> | DEFAULT
    RESET <name>
    SHOW <name>
    (empty query)

Every <text>, <model> and <options> is a SQL string constant, NULL, or (extended query
protocol) a parameter $n bound as text. String constants are parsed exactly as
PostgreSQL's lexer does ('' doubling, E'' escapes, U&'' escapes with UESCAPE, dollar quoting,
continuation across newlines, standard_conforming_strings). <options> is a string such as
'lane=batch,dimensions=256,prompt=query,normalize=false,truncate=false,timeout_ms=500'.
Anything else is
rejected with a `SqlError` carrying the SQLSTATE a PostgreSQL server would use.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.pgwire.lexer import (CHARACTER_NOT_IN_REPERTOIRE, FEATURE_NOT_SUPPORTED,
                                  INVALID_ESCAPE_SEQUENCE, INVALID_PARAMETER_VALUE, MAX_PARAMS,
                                  SYNTAX_ERROR, UNDEFINED_FUNCTION, UNDEFINED_OBJECT, Kind,
                                  Lexer, SqlError, Token)

__all__ = ["CHARACTER_NOT_IN_REPERTOIRE", "FEATURE_NOT_SUPPORTED", "INVALID_ESCAPE_SEQUENCE",
           "INVALID_PARAMETER_VALUE", "SYNTAX_ERROR", "UNDEFINED_FUNCTION", "UNDEFINED_OBJECT",
           "EmbedCall", "EmbedOptions", "EmptyQuery", "SetCommand", "ShowCommand", "SqlError",
           "Statement", "count_params", "parse", "parse_options"]


@dataclass(frozen=True)
class EmbedOptions:
    """The third argument of embed()/embed_many(), parsed."""

    lane: str = "online"              # "online" | "batch"
    dimensions: int = 0               # 0 = the model's full width
    prompt: str | None = None         # a prompt name the model defines ("query", "passage", ...)
    normalize: bool | None = None     # None = the model's default
    truncate: bool = True             # False = over-length text is an error
    timeout_ms: int = 0               # 0 = none; else queued work is dropped after this long


@dataclass(frozen=True)
class EmbedCall:
    """`SELECT embed(...)` (many=False, one text) or `SELECT embed_many(ARRAY[...])` (many=True)."""

    texts: tuple[str | None, ...]
    many: bool
    model: str                        # "" = the sidecar's default model
    options: EmbedOptions


@dataclass(frozen=True)
class SetCommand:
    """`SET name TO value`; value None means DEFAULT; `RESET name` is reset=True, value None."""

    name: str
    value: str | None
    reset: bool = False


@dataclass(frozen=True)
class ShowCommand:
    name: str


@dataclass(frozen=True)
class EmptyQuery:
    pass


Statement = EmbedCall | SetCommand | ShowCommand | EmptyQuery



class _Parser:
    def __init__(self, sql: str, standard_conforming_strings: bool,
                 params: Sequence[str | None] | None) -> None:
        self.lexer = Lexer(sql, standard_conforming_strings)
        self.params = params
        self.max_param = 0
        self.tok = self.lexer.next()

    def advance(self) -> Token:
        tok, self.tok = self.tok, self.lexer.next()
        return tok

    def syntax_error(self, tok: Token | None = None) -> SqlError:
        tok = tok or self.tok
        if tok.kind is Kind.EOF:
            return SqlError(SYNTAX_ERROR, "syntax error at end of input", tok.pos + 1)
        near = tok.text if len(tok.text) <= 40 else tok.text[:37] + "..."
        return SqlError(SYNTAX_ERROR, f'syntax error at or near "{near}"', tok.pos + 1)

    def keyword(self, word: str) -> bool:
        if self.tok.kind is Kind.IDENT and not self.tok.quoted and self.tok.value == word:
            self.advance()
            return True
        return False

    def expect_keyword(self, word: str) -> None:
        if not self.keyword(word):
            raise self.syntax_error()

    def punct(self, ch: str) -> bool:
        if self.tok.kind is Kind.PUNCT and self.tok.value == ch:
            self.advance()
            return True
        return False

    def expect_punct(self, ch: str) -> None:
        if not self.punct(ch):
            raise self.syntax_error()

    def statement(self) -> Statement:
        if self.tok.kind is Kind.EOF or (self.tok.kind is Kind.PUNCT and self.tok.value == ";"):
            self.finish()
            return EmptyQuery()
        if self.keyword("select"):
            stmt: Statement = self.select()
        elif self.keyword("set"):
            stmt = self.set_command()
        elif self.keyword("reset"):
            stmt = SetCommand(self.name(), None, reset=True)
        elif self.keyword("show"):
            stmt = ShowCommand(self.name())
        elif self.tok.kind is Kind.IDENT:
            raise SqlError(FEATURE_NOT_SUPPORTED,
                           f"Fern's SQL endpoint does not run {self.tok.text.upper()} statements; "
                           "it answers SELECT embed('text') and SELECT embed_many(ARRAY[...])",
                           self.tok.pos + 1)
        else:
            raise self.syntax_error()
        self.finish()
        return stmt

    def finish(self) -> None:
        if self.punct(";"):
            while self.punct(";"):
                pass
            if self.tok.kind is not Kind.EOF:
                raise SqlError(FEATURE_NOT_SUPPORTED,
                               "Fern's SQL endpoint runs one statement per query",
                               self.tok.pos + 1)
        if self.tok.kind is not Kind.EOF:
            raise self.syntax_error()

    def name(self) -> str:
        if self.tok.kind is not Kind.IDENT:
            raise self.syntax_error()
        return self.advance().value

    def set_command(self) -> SetCommand:
        if self.keyword("local"):
            raise SqlError(FEATURE_NOT_SUPPORTED, "SET LOCAL is not supported (no transactions)")
        self.keyword("session")
        name = self.name()
        if not (self.keyword("to") or self.punct("=")):
            raise self.syntax_error()
        if self.keyword("default"):
            return SetCommand(name, None)
        tok = self.tok
        if tok.kind in (Kind.STRING, Kind.IDENT, Kind.NUMBER):
            self.advance()
            return SetCommand(name, tok.value)
        if tok.kind is Kind.PUNCT and tok.value == "-":
            self.advance()
            if self.tok.kind is Kind.NUMBER:
                return SetCommand(name, "-" + self.advance().text)
        raise self.syntax_error()

    def select(self) -> EmbedCall:
        from_form = False
        if self.punct("*"):
            self.expect_keyword("from")
            from_form = True
        fn = self.tok
        if fn.kind is Kind.EOF:
            raise self.syntax_error()
        self.advance()
        if fn.kind is not Kind.IDENT or not (self.tok.kind is Kind.PUNCT
                                                and self.tok.value == "("):
            if from_form:
                raise SqlError(FEATURE_NOT_SUPPORTED,
                               "Fern's SQL endpoint selects only from embed(...) or embed_many(...)",
                               fn.pos + 1)
            raise SqlError(FEATURE_NOT_SUPPORTED,
                           "Fern's SQL endpoint answers only SELECT embed(...) and "
                           "SELECT embed_many(ARRAY[...])", fn.pos + 1)
        if fn.value not in ("embed", "embed_many"):
            raise SqlError(UNDEFINED_FUNCTION, f"function {fn.value}() does not exist",
                           fn.pos + 1, "Fern's SQL endpoint has embed(text, model, options) and "
                           "embed_many(text[], model, options).")
        self.expect_punct("(")
        many = fn.value == "embed_many"
        texts = self.text_array() if many else (self.literal("text"),)
        model, options = None, EmbedOptions()
        if self.punct(","):
            model = self.literal("model")
            if self.punct(","):
                options_tok = self.tok
                options = parse_options(self.literal("options") or "", options_tok.pos + 1)
        self.expect_punct(")")
        if self.tok.kind is Kind.IDENT and not self.tok.quoted and self.tok.value in (
                "as", "from", "where", "order", "limit", "union"):
            raise SqlError(FEATURE_NOT_SUPPORTED,
                           f"{self.tok.text.upper()} is not supported by Fern's SQL endpoint",
                           self.tok.pos + 1)
        return EmbedCall(texts=texts, many=many, model=model or "", options=options)

    def literal(self, what: str) -> str | None:
        """A string constant or NULL; anything else is not something the endpoint evaluates."""
        tok = self.tok
        if tok.kind is Kind.STRING:
            self.advance()
            return tok.value
        if tok.kind is Kind.IDENT and not tok.quoted and tok.value == "null":
            self.advance()
            return None
        if tok.kind is Kind.PARAM:
            self.advance()
            n = int(tok.value)
            if n < 1 or n > MAX_PARAMS:
                raise SqlError(SYNTAX_ERROR, f"there is no parameter ${tok.value}", tok.pos + 1)
            self.max_param = max(self.max_param, n)
            if self.params is None:
                raise SqlError(SYNTAX_ERROR, f"there is no parameter ${n}", tok.pos + 1,
                               "Parameters ($1, ...) need the extended query protocol.")
            if n > len(self.params):
                return ""  # Parse time: values not bound yet; Bind checks the count
            return self.params[n - 1]
        if tok.kind in (Kind.EOF,) or (tok.kind is Kind.PUNCT and tok.value in ",()"):
            raise self.syntax_error()
        raise SqlError(FEATURE_NOT_SUPPORTED,
                       f"the {what} argument must be a string literal or NULL", tok.pos + 1,
                       "Fern's SQL endpoint evaluates no expressions; quote values with "
                       "quote_literal() or format('%L').")

    def text_array(self) -> tuple[str | None, ...]:
        if not self.keyword("array"):
            tok = self.tok
            if tok.kind is Kind.EOF or (tok.kind is Kind.PUNCT and tok.value in ",()"):
                raise self.syntax_error()
            raise SqlError(FEATURE_NOT_SUPPORTED,
                           "embed_many takes ARRAY['text', ...] of string literals", tok.pos + 1)
        self.expect_punct("[")
        texts: list[str | None] = []
        if not self.punct("]"):
            while True:
                texts.append(self.literal("array element"))
                if self.punct("]"):
                    break
                self.expect_punct(",")
        return tuple(texts)


def parse(sql: str, *, standard_conforming_strings: bool = True,
          params: Sequence[str | None] | None = None) -> Statement:
    """Parse one statement; raises SqlError with a PostgreSQL SQLSTATE.

    `params` are the text values of $1, $2, ... (extended query protocol); None (simple
    query protocol) makes a parameter reference an error.
    """
    return _Parser(sql, standard_conforming_strings, params).statement()


def count_params(sql: str, *, standard_conforming_strings: bool = True) -> int:
    """The highest $n a statement refers to (checking its grammar on the way)."""
    parser = _Parser(sql, standard_conforming_strings, ())
    parser.statement()
    return parser.max_param


_TRUE = {"true", "on", "yes", "1", "t", "y"}
_FALSE = {"false", "off", "no", "0", "f", "n"}


def parse_options(text: str, position: int | None = None) -> EmbedOptions:
    """'lane=batch, dimensions=256, prompt=query, normalize=false, truncate=false, timeout_ms=500'."""
    values: dict[str, object] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep:
            raise SqlError(INVALID_PARAMETER_VALUE,
                           f'options: "{item}" is not key=value', position)
        if key in values:
            raise SqlError(INVALID_PARAMETER_VALUE, f"options: {key} given twice", position)
        if key == "lane":
            if value.lower() not in ("online", "batch"):
                raise SqlError(INVALID_PARAMETER_VALUE,
                               f'options: lane must be online or batch, not "{value}"', position)
            values[key] = value.lower()
        elif key in ("dimensions", "timeout_ms"):
            if not value.isdigit():
                raise SqlError(INVALID_PARAMETER_VALUE,
                               f'options: {key} must be a non-negative integer, not "{value}"',
                               position)
            values[key] = int(value)
        elif key == "prompt":
            values[key] = value or None
        elif key in ("normalize", "truncate"):
            lowered = value.lower()
            if lowered not in _TRUE | _FALSE:
                raise SqlError(INVALID_PARAMETER_VALUE,
                               f'options: {key} must be true or false, not "{value}"', position)
            values[key] = lowered in _TRUE
        else:
            raise SqlError(INVALID_PARAMETER_VALUE,
                           f'options: unknown option "{key}" (known: lane, dimensions, prompt, '
                           "normalize, truncate, timeout_ms)", position)
    return dataclasses.replace(EmbedOptions(), **values)
