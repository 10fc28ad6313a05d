"""PostgreSQL's lexer (scan.l) for the endpoint's tiny grammar: exact string constants, identifiers, parameters."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# SQLSTATE codes the parser raises (PostgreSQL's errcodes.txt).
SYNTAX_ERROR = "42601"
UNDEFINED_FUNCTION = "42883"
UNDEFINED_OBJECT = "42704"
FEATURE_NOT_SUPPORTED = "0A000"
INVALID_PARAMETER_VALUE = "22023"
INVALID_ESCAPE_SEQUENCE = "22025"
CHARACTER_NOT_IN_REPERTOIRE = "22021"

MAX_PARAMS = 65535  # the protocol's limit


class SqlError(Exception):
    """A statement the endpoint refuses; `sqlstate` and `position` (1-based characters) go to the client."""

    def __init__(self, sqlstate: str, message: str, position: int | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message
        self.position = position
        self.hint = hint


class Kind(enum.Enum):
    IDENT = "identifier"
    STRING = "string"
    NUMBER = "number"
    PUNCT = "punctuation"
    PARAM = "parameter"
    EOF = "end of input"


@dataclass(frozen=True)
class Token:
    kind: Kind
    value: str            # identifiers lower-cased unless quoted; strings decoded
    pos: int              # 0-based character offset of the token's first character
    text: str             # the source text, for "at or near" messages
    quoted: bool = False  # a "quoted identifier"


_SPACE = " \t\n\r\f\v"
_HORIZ_SPACE = " \t\f\v"
_HEX = "0123456789abcdefABCDEF"
_OCT = "01234567"
_SINGLE_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_PLAIN = re.compile(r"[^']+")
_PLAIN_ESCAPED = re.compile(r"[^'\\]+")


def _ident_start(ch: str) -> bool:
    return ch.isalpha() or ch == "_" or ord(ch) >= 0x80


def _ident_char(ch: str) -> bool:
    return _ident_start(ch) or ch.isdigit() or ch == "$"


class Lexer:
    """PostgreSQL's scan.l, restricted to what the grammar needs, with exact string constants."""

    def __init__(self, sql: str, standard_conforming_strings: bool) -> None:
        self.sql = sql
        self.i = 0
        self.scs = standard_conforming_strings

    def error(self, sqlstate: str, message: str, pos: int, hint: str | None = None) -> SqlError:
        return SqlError(sqlstate, message, pos + 1, hint)

    def _skip_space(self) -> None:
        sql, n = self.sql, len(self.sql)
        while self.i < n:
            ch = sql[self.i]
            if ch in _SPACE:
                self.i += 1
            elif sql.startswith("--", self.i):
                end = sql.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            elif sql.startswith("/*", self.i):
                self._skip_block_comment()
            else:
                return

    def _skip_block_comment(self) -> None:
        start, depth, self.i = self.i, 1, self.i + 2
        while depth:
            if self.i >= len(self.sql):
                raise self.error(SYNTAX_ERROR, "unterminated /* comment", start)
            if self.sql.startswith("/*", self.i):
                depth, self.i = depth + 1, self.i + 2
            elif self.sql.startswith("*/", self.i):
                depth, self.i = depth - 1, self.i + 2
            else:
                self.i += 1

    def next(self) -> Token:
        self._skip_space()
        sql, start = self.sql, self.i
        if start >= len(sql):
            return Token(Kind.EOF, "", start, "")
        ch = sql[start]
        nxt = sql[start + 1] if start + 1 < len(sql) else ""
        if ch == "'":
            return self._string(start, start, escapes=not self.scs)
        if ch in "eE" and nxt == "'":
            return self._string(start, start + 1, escapes=True)
        if ch in "uU" and nxt == "&" and sql.startswith("'", start + 2):
            return self._unicode_string(start)
        if ch in "bBxXnN" and nxt == "'":
            kind = "national character" if ch in "nN" else "bit-string"
            raise self.error(FEATURE_NOT_SUPPORTED, f"{kind} literals are not supported", start)
        if ch == "$" and nxt.isdigit():
            j = start + 1
            while j < len(sql) and sql[j].isdigit():
                j += 1
            self.i = j
            return Token(Kind.PARAM, sql[start + 1:j], start, sql[start:j])
        if ch == "$" and (tag_end := self._dollar_tag_end(start)) is not None:
            return self._dollar_string(start, tag_end)
        if ch == '"':
            return self._quoted_ident(start)
        if _ident_start(ch):
            j = start + 1
            while j < len(sql) and _ident_char(sql[j]):
                j += 1
            self.i = j
            return Token(Kind.IDENT, sql[start:j].lower(), start, sql[start:j])
        if ch.isdigit() or (ch == "." and nxt.isdigit()):
            j = start
            while j < len(sql) and (sql[j].isalnum() or sql[j] in "._"):
                j += 1
            self.i = j
            return Token(Kind.NUMBER, sql[start:j], start, sql[start:j])
        self.i = start + 1
        return Token(Kind.PUNCT, ch, start, ch)

    # ---- string constants ------------------------------------------------------------

    def _continues(self) -> bool:
        """After a closing quote: whitespace holding a newline, then a quote, glues two constants."""
        sql, j, n = self.sql, self.i, len(self.sql)
        saw_newline = False
        while j < n:
            ch = sql[j]
            if ch in _HORIZ_SPACE:
                j += 1
            elif ch in "\n\r":
                saw_newline, j = True, j + 1
            elif sql.startswith("--", j):
                end = sql.find("\n", j)
                if end < 0:
                    return False
                j = end
            else:
                break
        if saw_newline and j < n and sql[j] == "'":
            self.i = j
            return True
        return False

    def _string(self, start: int, quote: int, escapes: bool) -> Token:
        """'...' (backslashes literal) or E'...' (backslash escapes), with continuations."""
        out = bytearray()
        self.i = quote
        while True:
            self._segment(out, escapes, start)
            if not self._continues():
                break
        return Token(Kind.STRING, self._decode(out, start), start, self.sql[start:self.i])

    def _segment(self, out: bytearray, escapes: bool, start: int) -> None:
        """One quoted segment from the quote at self.i; leaves self.i past its closing quote."""
        sql, n = self.sql, len(self.sql)
        plain = _PLAIN_ESCAPED if escapes else _PLAIN
        j = self.i + 1                                  # past the opening quote
        pending_high: tuple[int, int] | None = None     # (surrogate, its offset)
        while True:
            run = plain.match(sql, j)
            if run is not None:
                self._no_pending(pending_high)
                pending_high = None
                out += run.group().encode("utf-8", "surrogatepass")
                j = run.end()
            if j >= n:
                raise self.error(SYNTAX_ERROR, "unterminated quoted string", start)
            if sql[j] == "'":
                self._no_pending(pending_high)
                if j + 1 < n and sql[j + 1] == "'":
                    out += b"'"
                    j += 2
                    continue
                self.i = j + 1
                return
            # a backslash in an escaping string
            if j + 1 >= n:
                raise self.error(SYNTAX_ERROR, "unterminated quoted string", start)
            esc = sql[j + 1]
            if esc in "uU":
                width = 4 if esc == "u" else 8
                digits = sql[j + 2:j + 2 + width]
                if len(digits) != width or any(c not in _HEX for c in digits):
                    raise self.error(INVALID_ESCAPE_SEQUENCE, "invalid Unicode escape", j,
                                     "Unicode escapes must be \\uXXXX or \\UXXXXXXXX.")
                pending_high = self._add_code(out, int(digits, 16), pending_high, j)
                j += 2 + width
                continue
            self._no_pending(pending_high)
            pending_high = None
            if esc in _OCT:
                k = j + 1
                while k < n and k < j + 4 and sql[k] in _OCT:
                    k += 1
                out.append(int(sql[j + 1:k], 8) & 0xFF)
                j = k
            elif esc == "x" and j + 2 < n and sql[j + 2] in _HEX:
                k = j + 2
                while k < n and k < j + 4 and sql[k] in _HEX:
                    k += 1
                out.append(int(sql[j + 2:k], 16))
                j = k
            else:
                out += _SINGLE_ESCAPES.get(esc, esc).encode("utf-8", "surrogatepass")
                j += 2

    def _add_code(self, out: bytearray, code: int, pending_high: tuple[int, int] | None,
                  pos: int) -> tuple[int, int] | None:
        """Append a Unicode escape's code point; a high surrogate waits for its low half."""
        if pending_high is not None:
            if not 0xDC00 <= code <= 0xDFFF:
                raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", pos)
            high = pending_high[0]
            code = 0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)
            out += chr(code).encode()
            return None
        if 0xD800 <= code <= 0xDBFF:
            return (code, pos)
        if 0xDC00 <= code <= 0xDFFF:
            raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", pos)
        if not 0 < code <= 0x10FFFF:
            raise self.error(SYNTAX_ERROR, "invalid Unicode escape value", pos)
        out += chr(code).encode()
        return None

    def _no_pending(self, pending_high: tuple[int, int] | None) -> None:
        if pending_high is not None:
            raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", pending_high[1])

    def _unicode_string(self, start: int) -> Token:
        """U&'...' [UESCAPE 'c']: \\XXXX and \\+XXXXXX escapes (only with standard_conforming_strings)."""
        if not self.scs:
            raise self.error(FEATURE_NOT_SUPPORTED,
                             "unsafe use of string constant with Unicode escapes", start,
                             "String constants with Unicode escapes cannot be used when "
                             "standard_conforming_strings is off.")
        raw = bytearray()
        self.i = start + 2
        while True:
            self._segment(raw, escapes=False, start=start)
            if not self._continues():
                break
        body = self._decode(raw, start)
        end = self.i
        escape = "\\"
        save = self.i
        after = self.next()
        if after.kind is Kind.IDENT and after.value == "uescape" and not after.quoted:
            lit = self.next()
            if (lit.kind is not Kind.STRING or len(lit.value) != 1
                    or lit.value in _HEX + "+'\"" or lit.value in _SPACE):
                raise self.error(SYNTAX_ERROR, "invalid Unicode escape character", lit.pos)
            escape, end = lit.value, self.i
        else:
            self.i = save
        return Token(Kind.STRING, self._unescape_unicode(body, escape, start), start,
                      self.sql[start:end])

    def _unescape_unicode(self, body: str, escape: str, start: int) -> str:
        out: list[str] = []
        pending_high: int | None = None
        j, n = 0, len(body)
        while j < n:
            ch = body[j]
            if ch != escape:
                if pending_high is not None:
                    raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", start)
                out.append(ch)
                j += 1
                continue
            if body[j + 1:j + 2] == escape:
                if pending_high is not None:
                    raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", start)
                out.append(escape)
                j += 2
                continue
            if body[j + 1:j + 2] == "+":
                digits, j_next = body[j + 2:j + 8], j + 8
            else:
                digits, j_next = body[j + 1:j + 5], j + 5
            if len(digits) not in (4, 6) or any(c not in _HEX for c in digits) or (
                    body[j + 1:j + 2] == "+" and len(digits) != 6):
                raise self.error(SYNTAX_ERROR, "invalid Unicode escape", start,
                                 "Unicode escapes must be \\XXXX or \\+XXXXXX.")
            code = int(digits, 16)
            if pending_high is not None:
                if not 0xDC00 <= code <= 0xDFFF:
                    raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", start)
                out.append(chr(0x10000 + ((pending_high - 0xD800) << 10) + (code - 0xDC00)))
                pending_high = None
            elif 0xD800 <= code <= 0xDBFF:
                pending_high = code
            elif 0xDC00 <= code <= 0xDFFF or not 0 < code <= 0x10FFFF:
                raise self.error(SYNTAX_ERROR, "invalid Unicode escape value", start)
            else:
                out.append(chr(code))
            j = j_next
        if pending_high is not None:
            raise self.error(SYNTAX_ERROR, "invalid Unicode surrogate pair", start)
        return "".join(out)

    def _dollar_tag_end(self, start: int) -> int | None:
        """If a $tag$ opens at `start`, the offset just past it."""
        sql, j = self.sql, start + 1
        if j < len(sql) and sql[j] != "$":
            if not (_ident_start(sql[j])):
                return None
            while j < len(sql) and (_ident_start(sql[j]) or sql[j].isdigit()):
                j += 1
        if j < len(sql) and sql[j] == "$":
            return j + 1
        return None

    def _dollar_string(self, start: int, tag_end: int) -> Token:
        tag = self.sql[start:tag_end]
        close = self.sql.find(tag, tag_end)
        if close < 0:
            raise self.error(SYNTAX_ERROR, "unterminated dollar-quoted string", start)
        self.i = close + len(tag)
        body = self.sql[tag_end:close]
        return Token(Kind.STRING, self._decode(body.encode("utf-8", "surrogatepass"), start),
                      start, self.sql[start:self.i])

    def _quoted_ident(self, start: int) -> Token:
        sql, j, parts = self.sql, start + 1, []
        while True:
            end = sql.find('"', j)
            if end < 0:
                raise self.error(SYNTAX_ERROR, "unterminated quoted identifier", start)
            parts.append(sql[j:end])
            if sql.startswith('""', end):
                parts.append('"')
                j = end + 2
                continue
            self.i = end + 1
            name = "".join(parts)
            if not name:
                raise self.error(SYNTAX_ERROR, "zero-length delimited identifier", start)
            return Token(Kind.IDENT, name, start, sql[start:self.i], quoted=True)

    def _decode(self, raw: bytes | bytearray, start: int) -> str:
        """Bytes built from escapes must form valid UTF-8 without NUL, as the server checks."""
        if 0 in raw:
            raise self.error(CHARACTER_NOT_IN_REPERTOIRE,
                             'invalid byte sequence for encoding "UTF8": 0x00', start)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = " ".join(f"0x{b:02x}" for b in bytes(raw)[exc.start:exc.start + 2])
            raise self.error(CHARACTER_NOT_IN_REPERTOIRE,
                             f'invalid byte sequence for encoding "UTF8": {bad}', start) from None
